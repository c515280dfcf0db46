"""What a ``sudo`` request runs: who may ask, the target user and group, the environment
(sudo's env_reset, secure_path, SUDO_*), argv and working directory. No I/O but reading the
file system to resolve commands and directories.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .state import DEFAULT_PATH, User, _strip_launcher_env
from .sudo_protocol import SUDO_GROUPS

if TYPE_CHECKING:
    from .state import Users

# sudo's default env_keep (plus what env_reset always keeps); LC_* is matched by prefix.
ENV_KEEP = frozenset(
    {
        "COLORS",
        "DISPLAY",
        "HOSTNAME",
        "KRB5CCNAME",
        "LS_COLORS",
        "PS1",
        "PS2",
        "TERM",
        "TZ",
        "XAUTHORITY",
        "XAUTHORIZATION",
        "XDG_CURRENT_DESKTOP",
        "LANG",
        "LANGUAGE",
        "LINGUAS",
        "COLORTERM",
    }
)


class Refused(Exception):
    """The request is not allowed or cannot be carried out: the sudo-style message."""


def _keep_var(name: str) -> bool:
    return name in ENV_KEEP or name.startswith("LC_")


def shell_quote_sudo(args: list[str]) -> str:
    """The command line sudo hands to ``shell -c`` for ``-s``/``-i``: every character but
    alphanumerics, ``_``, ``-`` and ``$`` backslash-escaped."""
    out = []
    for a in args:
        out.append("".join(c if c.isalnum() or c in "_-$" else "\\" + c for c in a))
    return " ".join(out)


def _str_map(value: object, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise Refused(f"sudo: bad request: {what} must be an object of strings")
    return value


def _which(cmd: str, path: str) -> str | None:
    for d in path.split(":"):
        if not d:
            continue
        p = os.path.join(d, cmd)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


class Plan:
    """What to run, as whom, where, with which environment."""

    def __init__(self) -> None:
        self.executable = ""
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.cwd = "/"
        self.uid = 0
        self.gid = 0
        self.groups: list[int] = []
        self.umask = 0o022
        self.tty = False


def authorize(users: Users, uid: int, gid: int) -> None:
    """Allowed: root, or a member of sudo/wheel/admin (sudoers is not parsed)."""
    if uid == 0:
        return
    caller = users.by_uid(uid)
    gids = {gid, *(caller.groups if caller else ())}
    if any(users.gid_name(g) in SUDO_GROUPS for g in gids):
        return
    name = caller.name if caller else str(uid)
    raise Refused(f"{name} is not in the sudoers file.")


def _target(users: Users, req: dict[str, Any], uid: int, gid: int) -> tuple[User, int]:
    user_s, group_s = req.get("user"), req.get("group")
    if user_s is not None and not isinstance(user_s, str):
        raise Refused("sudo: bad request: user")
    if group_s is not None and not isinstance(group_s, str):
        raise Refused("sudo: bad request: group")
    if user_s:
        if user_s.startswith("#") and user_s[1:].isdigit():
            target = users.by_uid(int(user_s[1:]))
        else:
            target = users.get(user_s)
        if target is None:
            raise Refused(f"sudo: unknown user {user_s}")
    elif group_s:  # -g without -u: the invoking user with another group
        target = users.by_uid(uid) or User(str(uid), uid, gid, "/", "/bin/sh")
    else:
        target = users.get("root") or User("root", 0, 0, "/root", "/bin/sh", (0,))
    primary = target.gid
    if group_s:
        if group_s.startswith("#") and group_s[1:].isdigit():
            primary = int(group_s[1:])
        else:
            g = users.group_gid(group_s)
            if g is None:
                raise Refused(f"sudo: unknown group {group_s}")
            primary = g
    return target, primary


def plan(users: Users, req: dict[str, Any], uid: int, gid: int) -> Plan:
    """The sudo semantics: target user, environment (env_reset), argv, cwd."""
    argv = req.get("argv") or []
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise Refused("sudo: bad request: argv must be a list of strings")
    caller_env = _strip_launcher_env(_str_map(req.get("env"), "env"))
    assign = _str_map(req.get("assign"), "assign")
    keep = req.get("keep") or []
    if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
        raise Refused("sudo: bad request: keep must be a list of strings")
    login = bool(req.get("login"))
    shell = bool(req.get("shell"))
    target, primary = _target(users, req, uid, gid)
    caller = users.by_uid(uid)
    caller_name = caller.name if caller else str(uid)

    # environment
    if req.get("preserve_env") and not login:
        env = dict(caller_env)
        if req.get("set_home"):
            env["HOME"] = target.home
    else:
        env = {k: v for k, v in caller_env.items() if _keep_var(k) or k in keep}
        env["HOME"] = target.home
        env["SHELL"] = target.shell or "/bin/sh"
        env["MAIL"] = f"/var/mail/{target.name}"
    if "SUDO_PS1" in caller_env:
        env["PS1"] = caller_env["SUDO_PS1"]
    env["PATH"] = DEFAULT_PATH if "PATH" not in keep else caller_env.get("PATH", DEFAULT_PATH)
    env["USER"] = env["LOGNAME"] = target.name
    env["SUDO_USER"] = caller_name
    env["SUDO_UID"] = str(uid)
    env["SUDO_GID"] = str(caller.gid if caller else gid)

    # argv
    cwd_req = req.get("cwd") if isinstance(req.get("cwd"), str) else None
    chdir = req.get("chdir") if isinstance(req.get("chdir"), str) else None
    if login or shell:
        if login:
            sh = target.shell or "/bin/sh"
        else:
            sh = caller_env.get("SHELL") or (caller.shell if caller else "") or "/bin/sh"
        executable = sh
        arg0 = "-" + os.path.basename(sh) if login else sh
        full = [arg0, "-c", shell_quote_sudo(argv)] if argv else [arg0]
        command_line = " ".join([sh, *full[1:]])
    else:
        if not argv:
            raise Refused("sudo: no command given")
        cmd = argv[0]
        if "/" in cmd:
            base = chdir or cwd_req or "/"
            resolved: str | None = os.path.join(base, cmd)
            if not os.path.exists(resolved or ""):
                resolved = None
        else:
            resolved = _which(cmd, env["PATH"])
        if resolved is None:
            raise Refused(f"sudo: {cmd}: command not found")
        executable = resolved
        full = list(argv)
        command_line = " ".join([resolved if "/" not in cmd else cmd, *argv[1:]])
    env["SUDO_COMMAND"] = command_line[:4096]
    for k, v in assign.items():
        if k and "=" not in k and "\0" not in k + v:
            env[k] = v

    # working directory
    if chdir:
        cwd = chdir if chdir.startswith("/") else os.path.join(cwd_req or "/", chdir)
        if not os.path.isdir(cwd):
            raise Refused(f"sudo: unable to change directory to {cwd}: No such directory")
    elif login:
        cwd = target.home if os.path.isdir(target.home) else "/"
    else:
        cwd = cwd_req if cwd_req and os.path.isdir(cwd_req) else "/"

    p = Plan()
    p.executable, p.argv, p.env, p.cwd = executable, full, env, cwd
    p.uid, p.gid = target.uid, primary
    p.groups = list(dict.fromkeys([primary, *target.groups]))
    umask = req.get("umask")
    p.umask = (umask if isinstance(umask, int) and 0 <= umask <= 0o777 else 0o022) | 0o022
    p.tty = bool(req.get("tty"))
    return p
