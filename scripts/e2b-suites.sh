#!/usr/bin/env bash
# E2B's own SDK test suites, run as E2B's CI runs them, against a node of this checkout:
# the clients get only E2B_DOMAIN and E2B_API_KEY (plus a test CA to trust); the node
# serves https://api.{domain} and https://{port}-{id}.{domain} on 127.0.0.1:443.
#
#   scripts/e2b-suites.sh /path/to/E2B [py-sync] [py-async] [py-shared] [js]   (default: all four)
#
# As root, on a host where `make install` has run and nothing else listens on 443 or serves
# from $AENV_HOME. `*.e2b.localhost` must resolve to loopback: Debian's libnss-myhostname
# (installed here, with `myhostname` in /etc/nsswitch.conf's hosts line, when missing).
# `ubuntu:22.04` (the suites' public image) is aliased to the local `base` template, since
# Docker Hub may be out of reach. Nothing of the E2B checkout is copied into this project:
# the tests run in place, the SDK's Python packages go to $E2B_VENV, its npm packages to the
# checkout's own node_modules (pnpm, as its lock file says).
#
# Settings (environment): AENV_HOME (default /var/lib/aenv), E2B_VENV (default
# /var/tmp/aenv-e2b-venv), WORKERS (pytest -n / vitest --maxWorkers, default 2), OUT (the
# node's log, certificates and JUnit reports; default a new directory under /tmp).
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
e2b=${1:?usage: scripts/e2b-suites.sh /path/to/E2B [py-sync] [py-async] [py-shared] [js]}
e2b=$(cd "$e2b" && pwd)
shift
suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=(py-sync py-async py-shared js)
for s in "${suites[@]}"; do
  case $s in py-sync | py-async | py-shared | js) ;; *) echo "unknown suite: $s" >&2; exit 2 ;; esac
done

DOMAIN=e2b.localhost
export AENV_HOME=${AENV_HOME:-/var/lib/aenv}
E2B_VENV=${E2B_VENV:-/var/tmp/aenv-e2b-venv}
WORKERS=${WORKERS:-2}
OUT=${OUT:-$(mktemp -d /tmp/aenv-e2b-suites.XXXXXX)}
mkdir -p "$OUT"
PY=$here/.venv/bin/python
[ -x "$PY" ] || { echo "no $PY: run make install first" >&2; exit 2; }

# Names: *.localhost to loopback through nss-myhostname.
if ! getent hosts "api.$DOMAIN" >/dev/null; then
  dpkg -s libnss-myhostname >/dev/null 2>&1 || apt-get install -y -q libnss-myhostname >/dev/null
  grep -Eq '^hosts:.*myhostname' /etc/nsswitch.conf ||
    sed -i -E 's/^(hosts:[[:space:]]*files)/\1 myhostname/' /etc/nsswitch.conf
  getent hosts "api.$DOMAIN" >/dev/null || { echo "api.$DOMAIN does not resolve" >&2; exit 2; }
fi
if ss -Hltn 'sport = :443' | grep -q .; then
  echo "something already listens on port 443" >&2
  exit 2
fi

# A test CA and a leaf for api.{domain} and *.{domain}; the clients trust the CA next to the
# system's (SSL_CERT_FILE replaces the default store).
"$PY" - "$OUT" "$DOMAIN" <<'EOF'
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

out, domain = Path(sys.argv[1]), sys.argv[2]
now = datetime.now(UTC)


def name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


ca_key = ec.generate_private_key(ec.SECP256R1())
ca = (
    x509.CertificateBuilder().subject_name(name("aenv e2b-suites CA")).issuer_name(name("aenv e2b-suites CA"))
    .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
    .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=2))
    .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
    .sign(ca_key, hashes.SHA256())
)
key = ec.generate_private_key(ec.SECP256R1())
leaf = (
    x509.CertificateBuilder().subject_name(name(f"api.{domain}")).issuer_name(ca.subject)
    .public_key(key.public_key()).serial_number(x509.random_serial_number())
    .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=2))
    .add_extension(x509.SubjectAlternativeName([x509.DNSName(f"api.{domain}"), x509.DNSName(f"*.{domain}")]), critical=False)
    .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    .sign(ca_key, hashes.SHA256())
)
pem = serialization.Encoding.PEM
(out / "ca.crt").write_bytes(ca.public_bytes(pem))
(out / "node.crt").write_bytes(leaf.public_bytes(pem) + ca.public_bytes(pem))
(out / "node.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
(out / "node.key").chmod(0o600)
EOF
cat /etc/ssl/certs/ca-certificates.crt "$OUT/ca.crt" >"$OUT/bundle.crt" 2>/dev/null || cp "$OUT/ca.crt" "$OUT/bundle.crt"

# The clients first: installing them (pip, pnpm) takes both cores for a while, and a node
# that just started (boot snapshot, pool, template builds) must not share them with it.
py_setup() {
  [ -x "$E2B_VENV/bin/pytest" ] && "$E2B_VENV/bin/python" -c 'import e2b, xdist, pytest_asyncio, pytest_timeout' 2>/dev/null && return
  python3 -m venv "$E2B_VENV"
  "$E2B_VENV/bin/pip" install -q -e "$e2b/packages/python-sdk" 'pytest>=9,<10' 'pytest-xdist>=3.3,<4' \
    'python-dotenv>=1,<2' 'pytest-dotenv>=0.5.2,<0.6' 'pytest-asyncio>=1.3,<2' 'pytest-timeout>=2.4,<3'
}

js_setup() {
  [ -d "$e2b/packages/js-sdk/node_modules/vitest" ] && return
  local pnpm
  pnpm=$(sed -n 's/.*"packageManager": *"\(pnpm@[^"]*\)".*/\1/p' "$e2b/package.json")
  (cd "$e2b" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 CI=1 npx -y "${pnpm:-pnpm@10}" install --filter 'e2b...' --frozen-lockfile --config.engine-strict=false)
}

for s in "${suites[@]}"; do
  case $s in py-*) py_setup || exit 1 ;; js) js_setup || exit 1 ;; esac
done

# The node, in the background with its own log; stopped by its pid whatever happens next.
KEY=e2b_$(openssl rand -hex 20)
node_pid=
stop_node() {
  [ -n "$node_pid" ] || return 0
  kill -TERM "$node_pid" 2>/dev/null
  for _ in $(seq 120); do kill -0 "$node_pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$node_pid" 2>/dev/null
  node_pid=
}
trap stop_node EXIT
trap 'exit 130' INT TERM
AENV_LISTEN=127.0.0.1:443 AENV_DOMAIN=$DOMAIN AENV_TLS_CERT=$OUT/node.crt AENV_TLS_KEY=$OUT/node.key \
  AENV_API_KEY=$KEY AENV_IMAGE_ALIASES='ubuntu:22.04=base,e2bdev/base=base,base=base,e2bdev/code-interpreter=code-interpreter-v1' \
  "$here/.venv/bin/aenv" server >"$OUT/node.log" 2>&1 &
node_pid=$!
echo "node: pid $node_pid, log $OUT/node.log, AENV_HOME=$AENV_HOME"
for _ in $(seq 240); do
  curl -sf --cacert "$OUT/ca.crt" "https://api.$DOMAIN/health" >/dev/null && break
  kill -0 "$node_pid" 2>/dev/null || { echo "the node exited; see $OUT/node.log" >&2; tail -20 "$OUT/node.log" >&2; exit 1; }
  sleep 0.5
done
curl -sf --cacert "$OUT/ca.crt" "https://api.$DOMAIN/health" >/dev/null || { echo "the node is not healthy" >&2; exit 1; }

# What the clients get: the domain, the key, the CA. Nothing else of E2B_*.
unset E2B_API_URL E2B_SANDBOX_URL E2B_VOLUME_API_URL E2B_DEBUG E2B_ACCESS_TOKEN
client_env=(E2B_DOMAIN=$DOMAIN E2B_API_KEY=$KEY SSL_CERT_FILE=$OUT/bundle.crt
  REQUESTS_CA_BUNDLE=$OUT/bundle.crt NODE_EXTRA_CA_CERTS=$OUT/ca.crt)

run_suite() {
  local suite=$1 report=$OUT/$1.xml
  echo "== $suite"
  case $suite in
    py-*)
      (cd "$e2b/packages/python-sdk" && env "${client_env[@]}" "$E2B_VENV/bin/pytest" -q -rfE \
        --numprocesses="$WORKERS" --junitxml="$report" "tests/${suite#py-}")
      ;;
    js)
      # Every project but the browser one (E2B's CI runs it in Playwright's Chromium).
      (cd "$e2b/packages/js-sdk" && env "${client_env[@]}" npx vitest run \
        --project unit --project template --project connectionConfig --maxWorkers="$WORKERS" \
        --reporter=default --reporter=junit --outputFile.junit="$report")
      ;;
  esac
}

for s in "${suites[@]}"; do run_suite "$s"; done
stop_node

echo "== counts (JUnit reports in $OUT)"
"$PY" - "$OUT" "${suites[@]}" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
status = 0
for suite in sys.argv[2:]:
    path = out / f"{suite}.xml"
    if not path.exists():
        print(f"{suite:10} no report")
        status = 1
        continue
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in ET.parse(path).iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            counts["failed"] += 1
            failures.append(f"{case.get('classname')}::{case.get('name')}")
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    status |= bool(counts["failed"])
    print(f"{suite:10} passed {counts['passed']:4}  failed {counts['failed']:4}  skipped {counts['skipped']:4}")
    for name in failures:
        print(f"    FAILED {name}")
sys.exit(status)
EOF
