#!/bin/sh
# Installs the Debian packages aenv needs. Idempotent: a second run with
# everything present touches nothing and returns in well under a second.
set -eu

PKGS="runsc debootstrap iproute2 iptables util-linux e2fsprogs btrfs-progs procps ca-certificates gcc libc6-dev \
qemu-system-x86 curl redis-server docker-registry skopeo psmisc python3-venv busybox-static \
chromium fonts-liberation prometheus"

missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
# runsc must be the bookworm-backports build (>= 20240729): checkpoint --leave-running and
# network namespaces only work from that release on.
if command -v runsc >/dev/null 2>&1; then
    runsc --version 2>/dev/null | grep -Eq '20(2[4-9]|[3-9][0-9])' || missing="$missing runsc"
fi
# Node runs the npm e2b SDK in the tests and installs the console's pinned xterm.js; the
# machine image may already ship one. Chromium: the console's tests drive it headless.
command -v node >/dev/null 2>&1 || missing="$missing nodejs npm"
[ -z "$missing" ] && exit 0

src=/etc/apt/sources.list.d/bookworm-backports.sources
if [ ! -f "$src" ]; then
    uris=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | grep -v security | head -n1)
    [ -n "$uris" ] || uris=http://deb.debian.org/debian
    cat >"$src" <<SRC
Types: deb
URIs: $uris
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
echo "aenv: installing system packages:$missing" >&2
export DEBIAN_FRONTEND=noninteractive
# Two installs at once (two `make test` on a fresh machine) take turns at dpkg's lock.
apt="apt-get -o DPkg::Lock::Timeout=900"
$apt update -qq
$apt install -y -qq --no-install-recommends $(echo "$missing" | sed 's/runsc//') >/dev/null
case "$missing" in *runsc*) $apt install -y -qq --no-install-recommends -t bookworm-backports runsc >/dev/null ;; esac
# The packaged services must not hold ports the tests use; tests start their own (which
# this must not stop: another session's may be running), so only the packaged commands.
# (prometheus: tests/integration/test_prometheus_scrape.py scrapes a node and a gateway with
# one of its own; the packaged one would hold :9090 and scrape nothing of ours.)
systemctl disable --now redis-server docker-registry prometheus >/dev/null 2>&1 || true
pkill -f "^/usr/bin/redis-server 127.0.0.1:6379" 2>/dev/null || true
pkill -f "^/usr/bin/docker-registry serve /etc/docker/registry" 2>/dev/null || true
pkill -x -f "/usr/bin/prometheus" 2>/dev/null || true
