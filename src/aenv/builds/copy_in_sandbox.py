"""COPY, run inside a build sandbox by envd's bundled Python (stdlib only, no image tools).

    python -c <this file> '<json spec>'

spec: {"tar": archive path, "src": pattern relative to the context, "dest": path,
       "owner": "user[:group]" | "uid[:gid]" | "", "mode": "0755" | "", "workdir": dir,
       "root": "/" (tests use a scratch dir)}

Docker's semantics: a directory source copies its contents into dest; a file goes to dest,
or into it when dest ends with "/", is an existing directory, or several sources match.
Directories created on the way belong to the owner (as BuildKit does with --chown). The
archive and the scratch extraction are removed afterwards (nothing of them reaches the layer).
Exit status 2 with a one-line message on stderr for a user error (no match, bad owner).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat
import sys
import tarfile
from typing import Any, NoReturn


def fail(msg: str) -> NoReturn:
    sys.stderr.write(msg + "\n")
    sys.exit(2)


def read_table(root: str, name: str) -> list[list[str]]:
    try:
        with open(os.path.join(root, "etc", name), encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n").split(":") for line in f if not line.startswith("#")]
    except OSError:
        return []


def resolve_owner(root: str, owner: str) -> tuple[int, int] | None:
    if not owner:
        return None
    user, _, group = owner.partition(":")
    passwd = read_table(root, "passwd")
    groups = read_table(root, "group")
    if user.isdigit():
        uid = int(user)
        gid = next((int(r[3]) for r in passwd if len(r) > 3 and r[2] == user), uid)
    else:
        row = next((r for r in passwd if len(r) > 3 and r[0] == user), None)
        if row is None:
            if user != "root":
                fail(f"COPY: user {user!r} does not exist in the image")
            row = ["root", "x", "0", "0"]
        uid, gid = int(row[2]), int(row[3])
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            grow = next((r for r in groups if len(r) > 2 and r[0] == group), None)
            if grow is None:
                fail(f"COPY: group {group!r} does not exist in the image")
            gid = int(grow[2])
    return uid, gid


def inside(root: str, path: str) -> str:
    """`path` (absolute in the sandbox) under `root`."""
    return os.path.join(root, path.lstrip("/"))


def makedirs(path: str, owner: tuple[int, int] | None, created: list[str]) -> None:
    parts = []
    p = path
    while not os.path.lexists(p):
        parts.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(parts):
        os.mkdir(d, 0o755)
        created.append(d)
        if owner:
            os.lchown(d, owner[0], owner[1])


def copy_entry(src: str, dst: str, touched: list[tuple[str, bool]]) -> None:
    st = os.lstat(src)
    if os.path.lexists(dst) and (stat.S_ISLNK(st.st_mode) or not os.path.isdir(dst)):
        if os.path.isdir(dst) and not os.path.islink(dst):
            shutil.rmtree(dst)
        else:
            os.unlink(dst)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISDIR(st.st_mode):
        if not os.path.isdir(dst):
            os.mkdir(dst, stat.S_IMODE(st.st_mode))
        for name in sorted(os.listdir(src)):
            copy_entry(os.path.join(src, name), os.path.join(dst, name), touched)
    else:
        shutil.copyfile(src, dst, follow_symlinks=False)
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    touched.append((dst, stat.S_ISLNK(st.st_mode)))


def main(spec: dict[str, Any]) -> None:
    root = spec.get("root") or "/"
    tar_path = inside(root, spec["tar"])
    scratch = tar_path + ".d"
    try:
        owner = resolve_owner(root, spec.get("owner") or "")
        mode = int(spec["mode"], 8) if spec.get("mode") else None
        os.makedirs(scratch, exist_ok=True)
        with tarfile.open(tar_path, "r:*") as tf:
            # "tar", not "data": a build context's absolute symlinks are kept as Docker's
            # COPY keeps them (they point into the image, not at the scratch directory);
            # members that would land outside the scratch directory are still refused.
            tf.extractall(scratch, filter="tar")
        src = spec["src"].strip()
        pattern = os.path.normpath(os.path.join(scratch, src.rstrip("/") or "."))
        if not (pattern == scratch or pattern.startswith(scratch + os.sep)):
            fail(f"COPY: source {src!r} is outside the build context")
        matches = (
            sorted(glob.glob(pattern))
            if glob.has_magic(src)
            else ([pattern] if os.path.lexists(pattern) else [])
        )
        if not matches:
            fail(f"COPY: no source files were specified ({src!r} matched nothing)")
        dest = spec["dest"]
        if not dest.startswith("/"):
            dest = os.path.join(spec.get("workdir") or "/", dest)
        into_dir = dest.endswith("/") or len(matches) > 1
        dest_path = inside(root, os.path.normpath(dest))
        created: list[str] = []
        touched: list[tuple[str, bool]] = []
        for m in matches:
            is_dir = os.path.isdir(m) and not os.path.islink(m)
            if is_dir:
                makedirs(dest_path, owner, created)
                for name in sorted(os.listdir(m)):
                    copy_entry(os.path.join(m, name), os.path.join(dest_path, name), touched)
                continue
            if into_dir or os.path.isdir(dest_path):
                makedirs(dest_path, owner, created)
                target = os.path.join(dest_path, os.path.basename(m))
            else:
                makedirs(os.path.dirname(dest_path), owner, created)
                target = dest_path
            copy_entry(m, target, touched)
        for path, is_link in touched:
            if owner:
                os.lchown(path, owner[0], owner[1])
            elif not is_link:
                os.lchown(path, 0, 0)
            if mode is not None and not is_link:
                os.chmod(path, mode)
        n = len(touched)
        sys.stdout.write(f"copied {n} entr{'y' if n == 1 else 'ies'}\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            os.unlink(tar_path)
            os.rmdir(os.path.dirname(tar_path))
        except OSError:
            pass


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
