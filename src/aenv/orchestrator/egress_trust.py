"""The node's egress CA in a sandbox's trust stores: what makes the egress proxy's
certificates for hosts with header `rules` (`runtime/net/egress_intercept.py`) trusted
inside, so those hosts' HTTPS can be opened at egress and their secrets added there.

Done at every envd /init of a sandbox whose rules have transforms (a create, a pre-booted
sandbox adopted, a fork child, a sandbox from a snapshot), and only for those: Debian's
`/usr/local/share/ca-certificates/` (kept by a later `update-ca-certificates`) and the bundle
`/etc/ssl/certs/ca-certificates.crt` that OpenSSL, curl and Python read, plus the variables
that point requests (certifi), Node and other clients at them. Only the certificate goes in,
never a key or a secret."""

from __future__ import annotations

import logging

from ..envd_client import EnvdClient

log = logging.getLogger("aenv.orchestrator")

CA_FILE = "/usr/local/share/ca-certificates/aenv-egress-ca.crt"
BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# For the sandbox's processes; a variable the user set at create wins.
TRUST_ENV = {
    "SSL_CERT_FILE": BUNDLE,
    "REQUESTS_CA_BUNDLE": BUNDLE,
    "NODE_EXTRA_CA_CERTS": CA_FILE,
}
# POSIX sh only (no grep or sed in a minimal image); appends the CA to the bundle once, so
# a sandbox restored from a snapshot that has it is left as it is.
_SCRIPT = f"""set -e
mkdir -p /usr/local/share/ca-certificates /etc/ssl/certs
printf '%s\\n' "$AENV_EGRESS_CA" > {CA_FILE}
chmod 0644 {CA_FILE}
if [ -f {BUNDLE} ]; then
  case "$(cat {BUNDLE})" in
    *"$AENV_EGRESS_CA"*) exit 0 ;;
  esac
fi
printf '%s\\n' "$AENV_EGRESS_CA" >> {BUNDLE}
"""


async def install_ca(client: EnvdClient, pem: bytes) -> None:
    """Puts the CA certificate `pem` into the sandbox's trust stores, as root. A failure is
    logged, not raised: the sandbox still runs, and HTTPS to its rules' hosts fails
    verification inside (loudly) instead of carrying headers."""
    try:
        end = await client.run(
            "/bin/sh",
            ["-c", _SCRIPT],
            user="root",
            envs={"AENV_EGRESS_CA": pem.decode().strip()},
            timeout=30,
        )
    except Exception as e:
        log.warning("egress CA not installed in the sandbox: %s", e)
        return
    if not end.exited or end.exit_code != 0:
        log.warning("egress CA not installed in the sandbox: exit %s %s", end.exit_code, end.error)
