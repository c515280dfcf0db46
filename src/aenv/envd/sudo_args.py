"""sudo's command line: options as getopt_long parses them, usage and help texts.

Standard library only, relative imports only: it is imported on every ``sudo``.
"""

from __future__ import annotations

VERSION = "1.9.13p3"

USAGE = """\
usage: sudo -h | -K | -k | -V
usage: sudo -v [-AknS] [-g group] [-u user]
usage: sudo -l [-AknS] [-g group] [-u user] [command [arg ...]]
usage: sudo [-AEHkNnPS] [-C num] [-D directory] [-g group] [-p prompt] [-u user]
            [VAR=value] [-i | -s] [command [arg ...]]
"""

HELP = (
    "sudo - execute a command as another user (aenv sandbox edition: no password, "
    "commands are run by envd)\n\n"
    + USAGE
    + """
Options:
  -A, --askpass                 ignored (never prompts)
  -C, --close-from=num          ignored
  -D, --chdir=directory         change the working directory before running command
  -E, --preserve-env            preserve user environment when running command
      --preserve-env=list       preserve specific environment variables
  -g, --group=group             run command as the specified group name or ID
  -H, --set-home                set HOME variable to target user's home dir
  -h, --help                    display help message and exit
  -i, --login                   run login shell as the target user; a command may also be
                                specified
  -K, --remove-timestamp        no-op (there are no credentials to forget)
  -k, --reset-timestamp         no-op
  -l, --list                    list user's privileges or check a specific command
  -n, --non-interactive         non-interactive mode (always the case here)
  -P, --preserve-groups         ignored
  -p, --prompt=prompt           ignored
  -S, --stdin                   ignored (no password is read)
  -s, --shell                   run shell as the target user; a command may also be
                                specified
  -u, --user=user               run command as specified user name or ID
  -V, --version                 display version information and exit
  -v, --validate                check that the user may use sudo
  --                            stop processing command line arguments
"""
)


class UsageError(Exception):
    def __init__(self, message: str, show_usage: bool = True) -> None:
        super().__init__(message)
        self.show_usage = show_usage


class Options:
    def __init__(self) -> None:
        self.mode = "run"  # run | help | version | validate | list | kill
        self.user: str | None = None
        self.group: str | None = None
        self.login = False
        self.shell = False
        self.preserve_env = False
        self.keep: list[str] = []
        self.set_home = False
        self.chdir: str | None = None
        self.reset_ts = False
        self.assign: dict[str, str] = {}
        self.command: list[str] = []


_SHORT_ARG = {"u": "user", "g": "group", "p": "prompt", "C": "close-from", "D": "chdir"}
_SHORT_FLAG = {
    "A": "askpass",
    "E": "preserve-env",
    "H": "set-home",
    "h": "help",
    "i": "login",
    "K": "remove-timestamp",
    "k": "reset-timestamp",
    "l": "list",
    "N": "no-update",
    "n": "non-interactive",
    "P": "preserve-groups",
    "S": "stdin",
    "s": "shell",
    "V": "version",
    "v": "validate",
}
_LONG_ARG = {"user", "group", "prompt", "close-from", "chdir"}
_LONG_FLAG = set(_SHORT_FLAG.values())
_UNSUPPORTED = {
    "b": "background",
    "e": "edit",
    "R": "chroot",
    "r": "role",
    "t": "type",
    "T": "command-timeout",
    "U": "other-user",
    "B": "bell",
}


def _set(o: Options, name: str, value: str | None) -> None:
    if name in ("askpass", "no-update", "non-interactive", "preserve-groups", "stdin"):
        return
    if name in ("prompt", "close-from"):
        return
    if name == "user":
        o.user = value
    elif name == "group":
        o.group = value
    elif name == "chdir":
        o.chdir = value
    elif name == "preserve-env":
        if value is None:
            o.preserve_env = True
        else:
            o.keep += [v for v in value.split(",") if v]
    elif name == "set-home":
        o.set_home = True
    elif name == "login":
        o.login = True
    elif name == "shell":
        o.shell = True
    elif name in ("reset-timestamp", "remove-timestamp"):
        o.reset_ts = True
        if name == "remove-timestamp":
            o.mode = "kill"
    elif name == "help":
        o.mode = "help"
    elif name == "version":
        o.mode = "version"
    elif name == "validate":
        o.mode = "validate"
    elif name == "list":
        o.mode = "list"


def parse_args(argv: list[str]) -> Options:
    """sudo's command line (getopt_long with "+": options stop at the first operand)."""
    o = Options()
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            if name in _LONG_ARG:
                if not eq:
                    i += 1
                    if i >= len(argv):
                        raise UsageError(f"option '--{name}' requires an argument")
                    value = argv[i]
                _set(o, name, value)
            elif name == "preserve-env":
                _set(o, name, value if eq else None)
            elif name in _LONG_FLAG:
                if eq:
                    raise UsageError(f"option '--{name}' doesn't allow an argument")
                _set(o, name, None)
            elif name in _UNSUPPORTED.values():
                raise UsageError(f"option '--{name}' is not supported in this sandbox", False)
            else:
                raise UsageError(f"unrecognized option '{a}'")
            i += 1
            continue
        if not a.startswith("-") or a == "-":
            break
        j = 1
        while j < len(a):
            c = a[j]
            if c in _SHORT_ARG:
                value = a[j + 1 :]
                if not value:
                    i += 1
                    if i >= len(argv):
                        raise UsageError(f"option requires an argument -- '{c}'")
                    value = argv[i]
                _set(o, _SHORT_ARG[c], value)
                break
            if c in _SHORT_FLAG:
                _set(o, _SHORT_FLAG[c], None)
            elif c in _UNSUPPORTED:
                raise UsageError(f"option '-{c}' is not supported in this sandbox", False)
            else:
                raise UsageError(f"invalid option -- '{c}'")
            j += 1
        i += 1
    rest = argv[i:]
    # VAR=value before the command
    while rest and not rest[0].startswith("=") and "=" in rest[0]:
        k, _, v = rest[0].partition("=")
        o.assign[k] = v
        rest = rest[1:]
    o.command = rest
    if o.login and o.shell:
        raise UsageError("you may not specify both the -i and -s options")
    if o.mode == "run" and not o.command and not (o.login or o.shell):
        if o.reset_ts:
            o.mode = "kill"
        else:
            raise UsageError("")
    return o
