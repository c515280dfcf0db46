"""The node's typed records: what every layer passes (api, proxy, builds, orchestrator,
runtime). No I/O, no imports from the rest of aenv but the egress policy record
(`egress.py`). `basics.py` holds ids, timings, states and small records; `sandbox.py` the
sandbox record and its codec; `template.py` the template record and its codec."""

from ..egress import DEFAULT_DNS_SERVER as DEFAULT_DNS_SERVER
from ..egress import EgressPolicy as EgressPolicy
from ..egress import domain_matches as domain_matches
from ..egress import is_domain_entry as is_domain_entry
from .basics import DEFAULT_TEMPLATE as DEFAULT_TEMPLATE
from .basics import ENVD_PORT as ENVD_PORT
from .basics import HOLDS_MEMORY as HOLDS_MEMORY
from .basics import LIVE_STATES as LIVE_STATES
from .basics import BootInfo as BootInfo
from .basics import CreateRequest as CreateRequest
from .basics import Instance as Instance
from .basics import MountRequest as MountRequest
from .basics import PausedState as PausedState
from .basics import PauseTier as PauseTier
from .basics import PendingOp as PendingOp
from .basics import Quota as Quota
from .basics import SandboxState as SandboxState
from .basics import Timings as Timings
from .basics import Upstream as Upstream
from .basics import VolumeMount as VolumeMount
from .basics import new_id as new_id
from .basics import utcnow as utcnow
from .sandbox import Lineage as Lineage
from .sandbox import SandboxRecord as SandboxRecord
from .sandbox import record_from_json as record_from_json
from .sandbox import record_to_json as record_to_json
from .template import BuildInfo as BuildInfo
from .template import TemplateKind as TemplateKind
from .template import TemplateRecord as TemplateRecord
