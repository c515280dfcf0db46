"""Data plane: route requests to sandbox ports (HTTP streaming both ways, WebSocket)."""

from .dispatch import DEFAULT_PORT, Resolver, Route, SandboxRouter
from .http import HttpForwarder
from .pool import ConnectionPool
from .ws import WebSocketForwarder

__all__ = [
    "DEFAULT_PORT",
    "ConnectionPool",
    "HttpForwarder",
    "Resolver",
    "Route",
    "SandboxRouter",
    "WebSocketForwarder",
]
