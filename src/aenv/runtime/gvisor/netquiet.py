"""No TCP connection between the node and a sandbox when it is checkpointed.

runsc 20240729 restores a sandbox that had an open connection at checkpoint time with a
wedged netstack: envd's listener is reported readable but never accepts again, so envd
spins and the restored sandbox never answers. The node's own connections to the sandbox
(the proxy's and envd client's kept-alive ones) are therefore aborted first (sock_diag
SOCK_DESTROY, `sockdiag.py`). The resets reach the sandbox's netstack asynchronously,
though: a checkpoint taken right after them could still save the connections as open (a
hibernated sandbox then failed to resume about once in ten). So, when something was
aborted, a round trip through the sandbox follows as a barrier: a connection to envd's port
that the node half-closes and envd closes in turn; envd's close means the sandbox handled
the packets sent before it. Every step is best effort and bounded: a sandbox whose envd
does not answer is checkpointed all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aenv.runtime.gvisor import sockdiag

log = logging.getLogger("aenv.runtime")

# How long the barrier may take before the checkpoint goes ahead regardless (a loaded
# node answers in well under a second; 1 s was missed under 1,000 sandboxes).
BARRIER_SECONDS = 3.0


async def drop_connections(address: str, port: int) -> None:
    """Aborts the host's TCP connections to `address`; if there were any, waits for the
    sandbox to have seen that (a round trip to `port`, where envd listens)."""
    try:
        aborted = await asyncio.to_thread(sockdiag.destroy_tcp_to, address)
    except OSError as e:
        log.warning("could not drop connections to %s: %s", address, e)
        return
    if aborted:
        await barrier(address, port)


async def barrier(address: str, port: int, timeout: float = BARRIER_SECONDS) -> bool:
    """Connects to `address:port`, half-closes, and waits for the other side to close too;
    whether it did within `timeout`."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(address, port)
            writer.write_eof()
            while await reader.read(4096):
                pass
        return True
    except (OSError, TimeoutError) as e:
        log.info("no barrier round trip with %s:%d before its checkpoint: %r", address, port, e)
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
