#!/usr/bin/env bash
# Debian's Docker engine and docker-compose, for `make image` and `make compose-test` (not
# for `make run`/`make test`: aenv itself runs sandboxes with runsc, no Docker needed).
set -euo pipefail
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
if ((${#need[@]})); then
    echo "installing ${need[*]} (Debian's)"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
        --no-install-recommends "${need[@]}" >/dev/null
fi
# The engine: the one running, or one started now (a host without systemd has none).
if ! /usr/bin/docker info >/dev/null 2>&1; then
    echo "starting dockerd (log: /var/log/aenv-dockerd.log)"
    nohup dockerd >>/var/log/aenv-dockerd.log 2>&1 &
    for _ in $(seq 120); do
        /usr/bin/docker info >/dev/null 2>&1 && exit 0
        sleep 0.5
    done
    echo "dockerd did not start: see /var/log/aenv-dockerd.log" >&2
    exit 1
fi
