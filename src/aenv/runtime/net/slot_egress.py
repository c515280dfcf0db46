"""Egress and secrets of a backend whose sandboxes each hold a network slot: the rules live
in the slot's namespace, not in the sandbox, so they apply to a running, paused or stopped
sandbox alike. Both backends mix this in; what they hold per sandbox only needs a slot."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from aenv.domain import EgressPolicy
from aenv.egress import SecretLookup
from aenv.errors import RuntimeFailure
from aenv.runtime.base import Instance
from aenv.runtime.net.egress_ca import EgressCA
from aenv.runtime.net.network import Network


class HoldsSlot(Protocol):
    @property
    def slot(self) -> int: ...


class SlotEgress:
    network: Network
    egress_ca: EgressCA
    # What the backend holds per live sandbox, and the sandboxes being destroyed.
    _live: Mapping[str, HoldsSlot]
    _destroying: set[str]

    def use_secrets(self, lookup: SecretLookup) -> None:
        self.network.proxies.secrets = lookup

    @property
    def egress_ca_pem(self) -> bytes | None:
        return self.egress_ca.pem or None

    async def set_egress(self, inst: Instance, policy: EgressPolicy) -> None:
        held = self._live.get(inst.id)
        if held is None or inst.id in self._destroying:
            raise RuntimeFailure(f"{inst.id} is not a sandbox of this runtime")
        await self.network.apply_egress(held.slot, policy)
