"""hotswap.fleet: many engines as one (docs/fleet.md).

`Router(urls)` fronts several `python -m hotswap.engine.server` processes as one EngineClient;
`create_router_app(router)` is its HTTP front, and `python -m hotswap.fleet --urls ...` runs it.
"""

from __future__ import annotations

from typing import Any

from hotswap.fleet.affinity import PrefixAffinity
from hotswap.fleet.router import Router, ServersDisagree

__all__ = ["PrefixAffinity", "Router", "ServersDisagree", "create_router_app"]


def __getattr__(name: str) -> Any:
    # Lazy: the Python API needs no web framework.
    if name == "create_router_app":
        from hotswap.fleet.router_app import create_router_app

        return create_router_app
    raise AttributeError(name)
