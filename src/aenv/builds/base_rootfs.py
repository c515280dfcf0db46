"""The rootfs of template `base`: a Debian bookworm built with debootstrap from a recipe
(suite, packages, user, the sudo shim), configured for sandboxes, and kept in a machine-wide
cache (`/var/cache/aenv/base-<recipe>/`, override with `$AENV_CACHE_DIR`): debootstrap
(~1 min) runs once per machine and recipe. Registering it as a template: `base.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..config import Settings
from ..envd.sudo import SHIM_SCRIPT as SUDO_SHIM
from ..errors import AenvError
from ..fsutil import flock
from ..images.layers import tree_digest

SUITE = "bookworm"
VARIANT = "minbase"
# What the brief asks for, plus: netbase (/etc/services, /etc/protocols for getaddrinfo with
# service names), git and python3-pip (what agents reach for first; E2B's base has both).
PACKAGES: tuple[str, ...] = (
    "bash",
    "coreutils",
    "procps",
    "python3",
    "python3-pip",
    "sudo",
    "ca-certificates",
    "curl",
    "iproute2",
    "less",
    "netbase",
    "git",
)
USER_NAME = "user"
USER_UID = 1000
HOSTNAME = "sandbox"
# Bump when the post-debootstrap setup (users, files, cleanup) changes: gives a new cache dir.
# 2: /usr/bin/sudo is envd's sudo shim (Debian's binary diverted to /usr/bin/sudo.distrib).
# 3: /etc/profile asks bash's $EUID before spawning `id -u`.
# 4: /usr/bin/python -> python3 (E2B's base has `python`).
SETUP_VERSION = 4

DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_SECURITY_MIRROR = "http://deb.debian.org/debian-security"
DEFAULT_CACHE_DIR = Path("/var/cache/aenv")
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

ProgressFn = Callable[[str, str], None]


class BaseBuildError(AenvError):
    """debootstrap or the rootfs setup failed; the message carries the tool's last output."""


def recipe() -> dict[str, Any]:
    return {
        "suite": SUITE,
        "variant": VARIANT,
        "packages": sorted(PACKAGES),
        "user": [USER_NAME, USER_UID],
        "setup_version": SETUP_VERSION,
        # the shim installed as /usr/bin/sudo: a changed shim gives a new base
        "sudo_shim": hashlib.sha256(SUDO_SHIM.encode()).hexdigest()[:16],
    }


def recipe_hash() -> str:
    raw = json.dumps(recipe(), sort_keys=True).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("AENV_CACHE_DIR") or DEFAULT_CACHE_DIR)


# --- mirrors --------------------------------------------------------------------------------


def _deb822_stanzas(text: str) -> Iterator[dict[str, str]]:
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = ""
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line[0] in " \t" and key:
                fields[key] += " " + line.strip()
                continue
            if ":" in line:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                fields[key] = value.strip()
        if fields:
            yield fields


def host_mirrors(etc_apt: Path = Path("/etc/apt")) -> tuple[str | None, str | None]:
    """(main mirror, security mirror) from the host's apt sources, None where not found."""
    main: str | None = None
    security: str | None = None
    entries: list[tuple[list[str], list[str]]] = []  # (uris, suites)
    src_dir = etc_apt / "sources.list.d"
    files = sorted(src_dir.glob("*.sources")) if src_dir.is_dir() else []
    for f in files:
        with contextlib.suppress(OSError):
            for st in _deb822_stanzas(f.read_text()):
                if st.get("enabled", "yes").lower() == "no":
                    continue
                if "deb" not in st.get("types", "deb").split():
                    continue
                entries.append((st.get("uris", "").split(), st.get("suites", "").split()))
    legacy = [
        etc_apt / "sources.list",
        *(sorted(src_dir.glob("*.list")) if src_dir.is_dir() else []),
    ]
    for f in legacy:
        with contextlib.suppress(OSError):
            for line in f.read_text().splitlines():
                parts = line.split()
                if not parts or parts[0] != "deb":
                    continue
                parts = parts[1:]
                if parts and parts[0].startswith("["):
                    while parts and not parts[0].endswith("]"):
                        parts = parts[1:]
                    parts = parts[1:]
                if len(parts) >= 2:
                    entries.append(([parts[0]], [parts[1]]))
    for uris, suites in entries:
        if not uris:
            continue
        if main is None and SUITE in suites:
            main = uris[0].rstrip("/")
        if security is None and f"{SUITE}-security" in suites:
            security = uris[0].rstrip("/")
    return main, security


def mirrors(settings: Settings) -> tuple[str, str]:
    main, security = host_mirrors()
    if settings.debian_mirror:
        main = settings.debian_mirror.rstrip("/")
    return main or DEFAULT_MIRROR, security or DEFAULT_SECURITY_MIRROR


# --- the machine-wide cache -----------------------------------------------------------------


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()).rstrip("/") + "/"
    out: list[str] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == prefix[:-1] or mp.startswith(prefix):
                out.append(mp)
    return out


def publish_build_dir(work: Path, final: Path, meta: dict[str, Any]) -> None:
    """Puts a finished build directory (`work`, with its `meta.json`) in place of `final`.
    An old one (a forced rebuild) is moved away first: layers imported from it keep their
    own hard links, so nothing that uses it breaks."""
    (work / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    if final.exists():
        old = final.with_name(f".{final.name}.tmp-old-{os.getpid()}")
        os.rename(final, old)
        _remove_build_dir(old)
    os.rename(work, final)


def _remove_build_dir(path: Path) -> None:
    """Removes a (possibly half-built) rootfs: first unmounts whatever debootstrap left
    mounted inside (proc, sys, dev binds), then `rm -rf --one-file-system`."""
    if not path.exists():
        return
    for mp in sorted(_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True, check=False)
    left = _mounts_under(path)
    if left:
        raise BaseBuildError(f"cannot remove {path}: still mounted: {', '.join(left)}")
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], check=True)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()
    path.write_text(text)
    os.chown(path, 0, 0)
    path.chmod(mode)


def _chroot(rootfs: Path, *args: str) -> None:
    env = {"PATH": PATH, "LC_ALL": "C", "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive"}
    r = subprocess.run(
        ["chroot", str(rootfs), *args], env=env, capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        raise BaseBuildError(f"chroot {' '.join(args)}: {(r.stderr or r.stdout).strip()}")


def _empty_dir(path: Path, keep: tuple[str, ...] = ()) -> None:
    if not path.is_dir():
        return
    for entry in path.iterdir():
        if entry.name in keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


_DPKG_EXCLUDES = """\
# aenv base: keep the image small, also for packages installed later (like Debian's slim).
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
"""


def _fast_profile(profile: Path) -> None:
    """Every command the E2B SDK runs is `bash -l -c ...`, and Debian's /etc/profile spawns
    `id -u` to pick PATH: a fork + exec that costs more than the rest of the login in gVisor.
    bash knows its EUID; other shells (dash has no EUID) still ask `id`, so nothing changes
    but the cost."""
    text = profile.read_text()
    fast = text.replace('"$(id -u)"', '"${EUID:-$(id -u)}"')
    if fast == text:
        raise BaseBuildError(f"{profile} no longer has the expected `id -u` test")
    profile.write_text(fast)


def configure_rootfs(rootfs: Path, main_mirror: str, security_mirror: str) -> None:
    """Everything after debootstrap: users, host files, apt sources, cleanup."""
    # Users: root (exists) and `user` (uid 1000, own group, member of sudo, bash).
    _chroot(
        rootfs,
        "useradd",
        "--create-home",
        "--home-dir",
        f"/home/{USER_NAME}",
        "--uid",
        str(USER_UID),
        "--user-group",
        "--groups",
        "sudo",
        "--shell",
        "/bin/bash",
        USER_NAME,
    )
    _write(
        rootfs / "etc/sudoers.d/90-aenv-user",
        f"{USER_NAME} ALL=(ALL:ALL) NOPASSWD: ALL\n",
        0o440,
    )
    # gVisor sets no_new_privs on every process, so setuid sudo cannot become root: the
    # sudo command asks envd instead (aenv.envd.sudo). Debian's binary stays, diverted, so
    # that upgrades of the sudo package do not overwrite the shim.
    _chroot(rootfs, "dpkg-divert", "--local", "--rename", "--add", "/usr/bin/sudo")
    _write(rootfs / "usr/bin/sudo", SUDO_SHIM, 0o755)
    _fast_profile(rootfs / "etc/profile")
    # What Debian's python-is-python3 does (a file no package owns: installing that package
    # later replaces it without a conflict).
    python = rootfs / "usr/bin/python"
    if not python.exists() and not python.is_symlink():
        python.symlink_to("python3")
    _write(rootfs / "etc/hostname", f"{HOSTNAME}\n")
    _write(
        rootfs / "etc/hosts",
        f"127.0.0.1\tlocalhost {HOSTNAME}\n"
        "::1\t\tlocalhost ip6-localhost ip6-loopback\n"
        "ff02::1\t\tip6-allnodes\n"
        "ff02::2\t\tip6-allrouters\n",
    )
    # Placeholder: the runtime puts the sandbox's real resolver here at start.
    _write(
        rootfs / "etc/resolv.conf",
        "# placeholder written by aenv; the runtime replaces it when a sandbox starts\n"
        "nameserver 1.1.1.1\nnameserver 8.8.8.8\n",
    )
    _write(
        rootfs / "etc/apt/sources.list",
        f"deb {main_mirror} {SUITE} main\n"
        f"deb {main_mirror} {SUITE}-updates main\n"
        f"deb {security_mirror} {SUITE}-security main\n",
    )
    _write(rootfs / "etc/dpkg/dpkg.cfg.d/90-aenv-excludes", _DPKG_EXCLUDES)
    # `pip install` works as in E2B's images (as `user` it falls back to ~/.local).
    for marker in (rootfs / "usr/lib").glob("python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    # Mount point of the envd runtime bundle.
    opt = rootfs / "opt/aenv"
    opt.mkdir(parents=True, exist_ok=True)
    opt.chmod(0o755)

    # Cleanup: apt caches and lists, logs, docs/man/locales (see the dpkg excludes).
    _empty_dir(rootfs / "var/cache/apt/archives", keep=("partial", "lock"))
    _empty_dir(rootfs / "var/cache/apt/archives/partial")
    for p in (rootfs / "var/cache/apt").glob("*.bin"):
        p.unlink()
    _empty_dir(rootfs / "var/lib/apt/lists", keep=("partial", "lock"))
    _empty_dir(rootfs / "var/lib/apt/lists/partial")
    for p in (rootfs / "var/log").rglob("*"):
        if p.is_file() and not p.is_symlink():
            p.write_bytes(b"")
    for p in [
        *(rootfs / "var/cache/debconf").glob("*-old"),
        *(rootfs / "var/lib/dpkg").glob("*-old"),
    ]:
        p.unlink()
    for doc in (rootfs / "usr/share/doc").glob("*"):
        if doc.is_dir() and not doc.is_symlink():
            for entry in doc.iterdir():
                if entry.name == "copyright":
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
    _empty_dir(rootfs / "usr/share/man")
    _empty_dir(rootfs / "usr/share/info")
    _empty_dir(rootfs / "usr/share/locale", keep=("locale.alias",))
    for p in (rootfs / "root").glob(".*_history"):
        p.unlink()


def _debootstrap(target: Path, main_mirror: str, cache: Path, progress: ProgressFn | None) -> None:
    if shutil.which("debootstrap") is None and not Path("/usr/sbin/debootstrap").exists():
        raise BaseBuildError("debootstrap is not installed (apt-get install debootstrap)")
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    cmd = [
        "debootstrap",
        f"--variant={VARIANT}",
        f"--include={','.join(PACKAGES)}",
        "--components=main",
        f"--cache-dir={debs}",
    ]
    if KEYRING.exists():
        cmd.append(f"--keyring={KEYRING}")
    cmd += [SUITE, str(target), main_mirror]
    env = {k: v for k, v in os.environ.items() if k.lower().endswith("_proxy")}
    env.update({"PATH": PATH, "LC_ALL": "C", "DEBIAN_FRONTEND": "noninteractive"})
    tail: deque[str] = deque(maxlen=30)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if not line:
            continue
        tail.append(line)
        if progress:
            progress("debootstrap", line)
    rc = proc.wait()
    if rc != 0:
        log = target / "debootstrap/debootstrap.log"
        extra = ""
        with contextlib.suppress(OSError):
            extra = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise BaseBuildError(
            f"debootstrap failed (exit {rc}):\n" + "\n".join(tail) + ("\n" + extra if extra else "")
        )


def ensure_cached_rootfs(
    settings: Settings,
    *,
    force: bool = False,
    progress: ProgressFn | None = None,
    cache_dir: Path | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The machine-wide cached base rootfs for the current recipe, built if missing.

    Returns (rootfs dir, meta) where meta holds at least `digest`, `size`, `files`. Safe
    against concurrent callers (a file lock per recipe) and interrupted builds."""
    cache = cache_dir or cache_root()
    rh = recipe_hash()
    final = cache / f"base-{rh}"
    meta_path = final / "meta.json"
    with flock(cache / f"base-{rh}.lock"):
        if not force and meta_path.is_file() and (final / "rootfs").is_dir():
            return final / "rootfs", json.loads(meta_path.read_text())
        # Leftovers of interrupted builds of this recipe (we hold the lock: they are stale).
        for stale in cache.glob(f".base-{rh}.tmp-*"):
            _remove_build_dir(stale)
        work = cache / f".base-{rh}.tmp-{os.getpid()}"
        work.mkdir(parents=True)
        try:
            main_mirror, security_mirror = mirrors(settings)
            if progress:
                progress("debootstrap", f"{SUITE} from {main_mirror}")
            t0 = time.monotonic()
            _debootstrap(work / "rootfs", main_mirror, cache, progress)
            t_deboot = time.monotonic() - t0
            for mp in sorted(_mounts_under(work), key=len, reverse=True):
                subprocess.run(["umount", "-l", mp], capture_output=True, check=False)
            if progress:
                progress("configure", "users, sudo, hosts, cleanup")
            configure_rootfs(work / "rootfs", main_mirror, security_mirror)
            if progress:
                progress("hash", "computing the layer digest")
            digest, size, files = tree_digest(work / "rootfs")
            meta = {
                "digest": digest,
                "size": size,
                "files": files,
                "recipe": recipe(),
                "recipe_hash": rh,
                "mirror": main_mirror,
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
                "debootstrap_seconds": round(t_deboot, 1),
            }
            publish_build_dir(work, final, meta)
        except BaseException:
            _remove_build_dir(work)
            raise
    return final / "rootfs", meta
