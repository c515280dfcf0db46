"""Sandbox-wide state (access token, default env, default user/workdir) and users.

Users and groups are read from ``/etc/passwd`` and ``/etc/group`` directly (no
NSS), so this works on any image, including busybox and distroless ones.
"""

from __future__ import annotations

import os
import sys

PASSWD = "/etc/passwd"
GROUP = "/etc/group"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_PREFIX = "AENV_ENVD_"


class User:
    __slots__ = ("name", "uid", "gid", "home", "shell", "groups")

    def __init__(
        self, name: str, uid: int, gid: int, home: str, shell: str, groups: tuple[int, ...] = ()
    ) -> None:
        self.name = name
        self.uid = uid
        self.gid = gid
        self.home = home
        self.shell = shell
        self.groups = groups or (gid,)

    def __repr__(self) -> str:
        return f"User({self.name!r}, uid={self.uid}, gid={self.gid}, home={self.home!r})"


ROOT = User("root", 0, 0, "/root", "/bin/sh", (0,))


def _stamp(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0)
    return (st.st_mtime_ns, st.st_size)


def _read_lines(path: str) -> list[list[str]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        rows.append(line.split(":"))
    return rows


class Users:
    """Cached view of /etc/passwd and /etc/group, reloaded when they change."""

    def __init__(self, passwd: str = PASSWD, group: str = GROUP) -> None:
        self.passwd_path = passwd
        self.group_path = group
        self._stamp: tuple[tuple[int, int], tuple[int, int]] | None = None
        self._users: dict[str, User] = {}
        self._uid_names: dict[int, str] = {}
        self._gid_names: dict[int, str] = {}
        self._group_gids: dict[str, int] = {}

    def _load(self) -> None:
        stamp = (_stamp(self.passwd_path), _stamp(self.group_path))
        if stamp == self._stamp:
            return
        members: dict[str, list[int]] = {}
        gid_names: dict[int, str] = {}
        group_gids: dict[str, int] = {}
        for row in _read_lines(self.group_path):
            if len(row) < 3:
                continue
            try:
                gid = int(row[2])
            except ValueError:
                continue
            gid_names.setdefault(gid, row[0])
            group_gids.setdefault(row[0], gid)
            if len(row) > 3:
                for m in row[3].split(","):
                    m = m.strip()
                    if m:
                        members.setdefault(m, []).append(gid)
        users: dict[str, User] = {}
        uid_names: dict[int, str] = {}
        for row in _read_lines(self.passwd_path):
            if len(row) < 7:
                continue
            try:
                uid, gid = int(row[2]), int(row[3])
            except ValueError:
                continue
            name = row[0]
            groups = [gid] + [g for g in members.get(name, []) if g != gid]
            users.setdefault(name, User(name, uid, gid, row[5] or "/", row[6], tuple(groups)))
            uid_names.setdefault(uid, name)
        if "root" not in users:
            users["root"] = ROOT
        uid_names.setdefault(0, "root")
        gid_names.setdefault(0, "root")
        group_gids.setdefault("root", 0)
        self._users, self._uid_names, self._gid_names = users, uid_names, gid_names
        self._group_gids = group_gids
        self._stamp = stamp

    def get(self, name: str) -> User | None:
        self._load()
        return self._users.get(name)

    def uid_name(self, uid: int) -> str:
        self._load()
        return self._uid_names.get(uid, str(uid))

    def gid_name(self, gid: int) -> str:
        self._load()
        return self._gid_names.get(gid, str(gid))

    def by_uid(self, uid: int) -> User | None:
        """The first passwd entry with this uid (None if there is none)."""
        self._load()
        name = self._uid_names.get(uid)
        return self._users.get(name) if name is not None else None

    def group_gid(self, name: str) -> int | None:
        self._load()
        return self._group_gids.get(name)


# Set by the runtime bundle's launcher for envd's own interpreter only (kept equal to
# aenv.runtime.bundle.ENVD_ONLY_ENV, checked by a unit test). The image's environment
# reaches processes through /init envVars, so these are dropped unconditionally.
LAUNCHER_ENV = (
    "PYTHONHOME",
    "PYTHONPATH",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONNOUSERSITE",
    "PYTHONUTF8",
    "PYTHONCOERCECLOCALE",
    "PYTHONUNBUFFERED",
)


def _strip_launcher_env(env: dict[str, str]) -> dict[str, str]:
    """The environment processes inherit: envd's own minus its launcher's vars.

    Removed: ``AENV_*`` (envd configuration), ``LAUNCHER_ENV`` and
    ``LD_LIBRARY_PATH`` when it points into envd's own runtime bundle.
    """
    bundle_roots = {
        p for p in (sys.prefix, sys.base_prefix) if p not in ("/usr", "/usr/local", "/")
    }
    bundle_roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = {}
    for k, v in env.items():
        if k.startswith("AENV_") or k in LAUNCHER_ENV:
            continue
        if k == "LD_LIBRARY_PATH" and any(
            part == root or part.startswith(root + "/")
            for part in v.split(":")
            for root in bundle_roots
        ):
            continue
        out[k] = v
    return out


class State:
    def __init__(self, base_env: dict[str, str] | None = None) -> None:
        self.users = Users()
        self.access_token: str | None = None
        self.env_vars: dict[str, str] = {}
        self.default_user: str | None = None  # None: "user" if it exists, else "root"
        self.default_workdir: str | None = None
        self.base_env: dict[str, str] = base_env or {}
        self.last_init_ts: float | None = None
        # The sandbox whose identity envd gave this machine (identity.py): a checkpoint
        # carries it, so a restore named differently by /init renews it.
        self.sandbox_id: str | None = None

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> State:
        env = dict(os.environ if environ is None else environ)
        st = cls(base_env=_strip_launcher_env(env))
        # Tests point envd at fake user databases; in a sandbox these are unset.
        passwd = env.get(ENV_PREFIX + "PASSWD_FILE")
        group = env.get(ENV_PREFIX + "GROUP_FILE")
        if passwd or group:
            st.users = Users(passwd or PASSWD, group or GROUP)
        st.access_token = env.get(ENV_PREFIX + "ACCESS_TOKEN") or None
        st.default_user = env.get(ENV_PREFIX + "DEFAULT_USER") or None
        st.default_workdir = env.get(ENV_PREFIX + "DEFAULT_WORKDIR") or None
        return st

    def default_user_obj(self) -> User:
        if self.default_user:
            u = self.users.get(self.default_user)
            if u is not None:
                return u
        return self.users.get("user") or self.users.get("root") or ROOT

    def process_env(self, user: User, envs: dict[str, str]) -> dict[str, str]:
        env = dict(self.base_env)
        env["HOME"] = user.home
        env["USER"] = user.name
        env["LOGNAME"] = user.name
        env["SHELL"] = user.shell or "/bin/sh"
        if not env.get("PATH"):
            env["PATH"] = DEFAULT_PATH
        env.update(self.env_vars)
        env.update(envs)
        return env

    def workdir(self, user: User, cwd: str | None) -> str:
        if cwd:
            return resolve_path(cwd, user)
        if self.default_workdir and os.path.isdir(self.default_workdir):
            return self.default_workdir
        return user.home if os.path.isdir(user.home) else "/"


def resolve_path(path: str, user: User) -> str:
    """Absolute, normalised path; relative paths and ``~`` resolve against home.

    ValueError for a path no system call takes (a NUL byte): callers answer a 400."""
    if "\0" in path:
        raise ValueError("a path must not contain a NUL byte")
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    if not path.startswith("/"):
        path = os.path.join(user.home, path)
    norm = os.path.normpath(path)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    return norm
