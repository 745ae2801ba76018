"""hotswap.fleet: many engines as one (docs/fleet.md).

`Router(urls)` fronts several `python -m hotswap.engine.server` processes as one EngineClient;
`create_router_app(router)` is its HTTP front, and `python -m hotswap.fleet --urls ...` runs it.
`PDRouter(prefill=[...], decode=[...])` computes prompts on prefill engines and hands their KV
to decode engines (disagg.py). `RayFleet(model_path, replicas=N)` starts engine replicas as Ray
actors (`EngineReplica`) and is one EngineClient too; it needs the `ray` extra, imported only
when used.
"""

from __future__ import annotations

from typing import Any

from hotswap.fleet.affinity import PrefixAffinity
from hotswap.fleet.coordinator import ServersDisagree
from hotswap.fleet.disagg import PDRouter
from hotswap.fleet.router import Router

__all__ = ["EngineReplica", "PDRouter", "PrefixAffinity", "RayFleet", "ReplicaGone", "Router",
           "ServersDisagree", "create_router_app"]


def __getattr__(name: str) -> Any:
    # Lazy: the Python API needs no web framework, and no Ray unless a fleet is made.
    if name == "create_router_app":
        from hotswap.fleet.router_app import create_router_app

        return create_router_app
    if name == "RayFleet":
        from hotswap.fleet.ray_fleet import RayFleet

        return RayFleet
    if name == "ReplicaGone":
        from hotswap.fleet.dispatch import ReplicaGone

        return ReplicaGone
    if name == "EngineReplica":
        from hotswap.fleet.replica import EngineReplica

        return EngineReplica
    raise AttributeError(name)
