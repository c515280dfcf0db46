"""The node's core behind one facade (`Orchestrator`); see facade.py for its parts."""

from .facade import Orchestrator
from .fork import ForkResult

__all__ = ["ForkResult", "Orchestrator"]
