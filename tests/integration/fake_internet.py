"""A fake internet for egress tests: a network namespace of the test's own, joined to the host
by a veth pair on a documentation range, with documentation addresses that answer

* plain HTTP on :8080 and :80, and HTTPS on :443 (a test certificate; clients skip checks),
  each answer naming the address it was reached at and, on 80/443, the Host / SNI it got
  (`http <ip> <host>`, `https <ip> <sni>`), so a probe knows what arrived;
* DNS on `DNS` (:53, UDP): the test names of `NAMES` (`*.wild.test` too); others NXDOMAIN.

Nothing outside this machine is touched; every part is removed by name afterwards."""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests import netplan
from tests.tls import make_certs

from . import netns_host

# The session's own link and /27 (tests/netplan.py): two sessions' fake internets coexist.
NET_HOST, NET_PEER = netplan.link(0).host, netplan.link(0).peer
TARGETS = str(netplan.targets())
A, B, DNS = (str(netplan.targets()[i]) for i in (10, 20, 29))
PORT = 8080
# allowed.test and denied.test share an address: only the name tells them apart.
NAMES = {"allowed.test": A, "denied.test": A, "other.test": B, "*.wild.test": B}

SERVERS = r"""
import json, socket, ssl, struct, sys, threading
cert, key, dns_ip = sys.argv[1], sys.argv[2], sys.argv[3]
NAMES = json.loads(sys.argv[4])

def listen(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    return s

def head(c):
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 8192:
        chunk = c.recv(1024)
        if not chunk:
            break
        data += chunk
    for line in data.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"host":
            return v.strip().decode(errors="replace").rsplit(":", 1)[0]
    return "-"

def answer(c, body):
    body = (body + "\n").encode()
    c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

def plain(c):
    c.settimeout(5); c.recv(1024); answer(c, "ext " + c.getsockname()[0])

def http(c):
    c.settimeout(5); answer(c, "http %s %s" % (c.getsockname()[0], head(c)))

def https(c):
    seen = {}
    def sni(obj, name, _ctx):
        seen["name"] = name
    c.settimeout(5)
    local = c.getsockname()[0]
    tctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); tctx.load_cert_chain(cert, key)
    tctx.set_ciphers("ALL:@SECLEVEL=0")
    tctx.sni_callback = sni
    t = tctx.wrap_socket(c, server_side=True)
    head(t); answer(t, "https %s %s" % (local, seen.get("name") or "-"))
    t.close()

def serve(s, handler):
    while True:
        c = s.accept()[0]
        def run(c=c):
            try:
                handler(c)
            except Exception:
                pass
            finally:
                c.close()
        threading.Thread(target=run, daemon=True).start()

def lookup(name):
    name = name.lower().rstrip(".")
    if name in NAMES:
        return NAMES[name]
    for pat, ip in NAMES.items():
        if pat.startswith("*.") and name.endswith(pat[1:]):
            return ip
    return None

def dns():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((dns_ip, 53))
    while True:
        q, peer = u.recvfrom(512)
        try:
            qid, flags = struct.unpack("!HH", q[:4])
            i, labels = 12, []
            while q[i]:
                labels.append(q[i + 1 : i + 1 + q[i]].decode()); i += 1 + q[i]
            qtype = struct.unpack("!H", q[i + 1 : i + 3])[0]
            question = q[12 : i + 5]
            ip = lookup(".".join(labels))
            rd = flags & 0x0100
            if ip is None:
                u.sendto(struct.pack("!HHHHHH", qid, 0x8083 | rd, 1, 0, 0, 0) + question, peer)
            elif qtype != 1:
                u.sendto(struct.pack("!HHHHHH", qid, 0x8080 | rd, 1, 0, 0, 0) + question, peer)
            else:
                rr = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(ip)
                u.sendto(struct.pack("!HHHHHH", qid, 0x8080 | rd, 1, 1, 0, 0) + question + rr, peer)
        except Exception:
            pass

for port, handler in ((8080, plain), (80, http), (443, https)):
    threading.Thread(target=serve, args=(listen(port), handler), daemon=True).start()
dns()
"""


@contextlib.contextmanager
def fake_internet() -> Iterator[None]:
    """Up for the duration of the context; names unique per run."""
    ns, veth = netns_host.names("gx")
    setup = f"""set -e
ip netns add {ns}
ip link add {veth} type veth peer name eth0 netns {ns}
ip addr add {NET_HOST}/30 dev {veth}; ip link set {veth} up
ip -n {ns} addr add {NET_PEER}/30 dev eth0; ip -n {ns} link set eth0 up
ip -n {ns} link set lo up
ip -n {ns} addr add {A}/32 dev lo; ip -n {ns} addr add {B}/32 dev lo
ip -n {ns} addr add {DNS}/32 dev lo
ip route add {TARGETS} via {NET_PEER} dev {veth}
"""
    with tempfile.TemporaryDirectory(prefix="aeegx-") as tmp:
        certs = make_certs(Path(tmp), "fake-internet")
        with netns_host.serving(
            ns,
            veth,
            setup,
            SERVERS,
            [str(certs.cert), str(certs.key), DNS, json.dumps(NAMES)],
            lambda: all(b"ext " in host_get(ip, PORT) for ip in (A, B)),
            "the fake internet",
            undo=[["ip", "route", "del", TARGETS, "dev", veth]],
        ):
            yield


def host_get(ip: str, port: int) -> bytes:
    """An HTTP/1.0 GET from the host (busybox nc), the raw answer or b""."""
    cmd = f"printf 'GET /\\r\\n' | busybox nc -w 1 {ip} {port}"
    return subprocess.run(["sh", "-c", cmd], capture_output=True).stdout
