#!/bin/bash
# `make floors`: do the lower bounds in pyproject.toml hold? Every direct dependency (the
# base, the server and the test extra) at the lowest version its bound allows (uv's
# lowest-direct resolution; what they pull in is as new as it comes), installed into a
# scratch venv, then the unit tests there. Not part of `make test`: it resolves and
# downloads a second set of packages.
#   FLOORS_DIR   where the tools, the pinned list and the venv go (default /tmp/aenv-floors)
#   arguments    passed to pytest (e.g. -x, or a test file instead of tests/unit)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${FLOORS_DIR:-/tmp/aenv-floors}
PY=${PY:-python3}
start=$SECONDS

rm -rf "$DIR"
mkdir -p "$DIR"
# uv resolves at the lowest versions (pip cannot); it lives in a venv of its own.
"$PY" -m venv "$DIR/tools"
"$DIR/tools/bin/pip" install -q --disable-pip-version-check uv
UV="$DIR/tools/bin/uv"
# Resolved for the oldest Python pyproject.toml supports.
"$UV" pip compile -q pyproject.toml --extra server --extra test \
    --resolution lowest-direct --python-version 3.11 -o "$DIR/floors.txt"
"$UV" venv -q --python "$PY" "$DIR/venv"
export VIRTUAL_ENV="$DIR/venv"
"$UV" pip install -q -r "$DIR/floors.txt"
"$UV" pip install -q --no-deps -e .
echo "floors: $(grep -cE '^[a-z]' "$DIR/floors.txt") packages pinned in $DIR/floors.txt"

args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/unit)
"$DIR/venv/bin/python" -m pytest -q -rs -p no:cacheprovider "${args[@]}"
echo "floors: the unit tests pass at the lowest versions, $((SECONDS - start)) s in all"
