"""Request-scoped access to what `create_app` put on `app.state`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from aenv.config import Settings
from aenv.orchestrator import Orchestrator
from aenv.secretstore import SecretStore

from .idempotency import IdempotencyCache


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_orchestrator(request: Request) -> Orchestrator:
    orchestrator: Orchestrator = request.app.state.orchestrator
    return orchestrator


def get_idempotency(request: Request) -> IdempotencyCache:
    cache: IdempotencyCache = request.app.state.idempotency
    return cache


def get_secrets(request: Request) -> SecretStore:
    store: SecretStore = request.app.state.secrets
    return store


SettingsDep = Annotated[Settings, Depends(get_settings)]
OrchestratorDep = Annotated[Orchestrator, Depends(get_orchestrator)]
IdempotencyDep = Annotated[IdempotencyCache, Depends(get_idempotency)]
SecretsDep = Annotated[SecretStore, Depends(get_secrets)]
