"""`python3 -m aenv.codeinterp [--port 49999] [--cwd /home/user]` (inside the sandbox)."""

from __future__ import annotations

import argparse
import asyncio
import os

from .server import serve

PORT = 49999


def main() -> None:
    p = argparse.ArgumentParser(prog="aenv.codeinterp")
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--cwd", default=os.path.expanduser("~"))
    p.add_argument("--run-dir", default=os.path.expanduser("~/.cache/aenv-codeinterp"))
    a = p.parse_args()
    asyncio.run(serve(a.port, a.cwd, a.run_dir))


if __name__ == "__main__":
    main()
