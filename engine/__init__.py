"""hotswap.engine: the rollout engine (Engine in-process, RemoteEngine over HTTP), both an
EngineClient (docs/api.md#one-interface)."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineClient", "RemoteEngine"]


def __getattr__(name: str) -> Any:
    # Lazy: `import hotswap.engine.config` must not pull in torch models or HTTP clients.
    if name == "Engine":
        from hotswap.engine.engine import Engine

        return Engine
    if name == "RemoteEngine":
        from hotswap.engine.client.remote import RemoteEngine

        return RemoteEngine
    if name == "EngineClient":
        from hotswap.engine.client.protocol import EngineClient

        return EngineClient
    raise AttributeError(name)
