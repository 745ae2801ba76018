"""EngineReplica: one Engine inside a Ray actor (docs/fleet.md#the-replica-actor).

The class is plain Python so that importing it needs no Ray; `RayFleet` and the integrations
that place replicas in their own placement groups (verl, OpenRLHF) make the actor with
`ray.remote(EngineReplica)`. Tensor parallelism stays inside the actor, as in an Engine.

Calls arrive on Ray's threads (the actor is threaded, `max_concurrency` > 1), so a generate in
flight does not hold up a weight update, a load query or a health check.
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from hotswap.engine import Engine
from hotswap.engine.client.protocol import handoff_methods, interface_methods
from hotswap.weight_sync.bucket import dtype_to_str, str_to_dtype
from hotswap.weight_sync.delta import Delta

# (name, dtype, shape, bytes): what goes through Ray's object store
Packed = list[tuple[str, str, tuple[int, ...], np.ndarray]]

# Calls the fleet forwards by name (ReplicaClient spells out one method for each): the engine
# interface, minus generation and what the replica implements itself, plus its load.
FORWARDED = (interface_methods() - {"generate", "async_generate", "async_classify", "shutdown",
                                    "weight_sync_ranks", "model_name"}
             ) | {"get_load"} | handoff_methods()


class EngineReplica:
    """Holds one Engine(model_path, **engine_kwargs); with http_port (0: any free port) it
    also serves the engine's HTTP API on http_host."""

    def __init__(self, model_path: str, engine_kwargs: dict | None = None,
                 http_port: int | None = None, http_host: str = "127.0.0.1"):
        self.engine = Engine(model_path, **(engine_kwargs or {}))
        self.url: str | None = None
        self._server: Any = None
        if http_port is not None:
            self.url = self._serve(http_host, http_port)

    def _serve(self, host: str, port: int) -> str:
        import uvicorn

        from hotswap.engine.server.app import create_app

        if port == 0:
            with socket.socket() as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
        config = uvicorn.Config(create_app(self.engine), host=host, port=port,
                                log_level="warning")
        self._server = uvicorn.Server(config)
        threading.Thread(target=self._server.run, name="replica-http", daemon=True).start()
        return f"http://{host}:{port}"

    def info(self) -> dict[str, Any]:
        """Where it runs and what it holds (the fleet's health check)."""
        import ray

        load = self.engine.get_load()
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "weight_version": self.engine.get_weight_version(),
                "weight_sync_ranks": self.engine.weight_sync_ranks,
                "model_name": self.engine.model_name,
                "running": load["running"], "waiting": load["waiting"], "url": self.url,
                "node_ip": ray.util.get_node_ip_address()}

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One engine method by name (the interface's control calls)."""
        if method not in FORWARDED:
            raise ValueError(f"{method!r} is not an engine call a replica forwards")
        if kwargs.get("stream"):
            raise ValueError(f"{method}(stream=True): a stream is a Ray streaming generator "
                             "(generate_from_handoff_stream)")
        return getattr(self.engine, method)(*args, **kwargs)

    def generate_from_handoff_stream(self, handoff: dict, kwargs: dict[str, Any]
                                     ) -> Iterator[dict]:
        """A Ray streaming generator of generate_from_handoff's incremental outputs."""
        yield from self.engine.generate_from_handoff(handoff, **kwargs, stream=True)

    def free_port(self) -> int:
        """A TCP port free on this actor's node (a KV transfer group's master)."""
        import ray

        from hotswap.weight_sync.group import free_port

        return free_port(ray.util.get_node_ip_address())

    def generate(self, kwargs: dict[str, Any]) -> list[dict]:
        return self.engine.generate(**kwargs, stream=False)

    def generate_stream(self, kwargs: dict[str, Any]) -> Iterator[dict]:
        """A Ray streaming generator: the engine's incremental outputs, one object each."""
        yield from self.engine.generate(**kwargs, stream=True)

    def weights_dtype(self) -> str:
        return self.engine.weights_dtype

    def prepare_tensors(self, packed: Packed | Delta, model: str | None = None) -> dict:
        """Phase one of a two-phase update from tensors in the object store (pack_tensors):
        validated and checked while serving goes on; commit_weight_update applies them."""
        if isinstance(packed, Delta):  # small: through the object store as it is
            return self.engine.prepare_weights_from_tensor(packed, model=model)
        return self.engine.prepare_weights_from_tensor(unpack_tensors(packed), model=model)

    def update_tensors(self, packed: Packed, *args: Any, **kwargs: Any) -> dict:
        """update_weights_from_tensor with tensors from the object store (pack_tensors)."""
        return self.engine.update_weights_from_tensor(unpack_tensors(packed), *args, **kwargs)

    def weights_for_transfer(self) -> Packed:
        """The serving weights under their HF names, packed for the object store, for another
        replica to load (a replacement catching up with the fleet)."""
        if self.engine.config.tp_size > 1:
            raise ValueError("a tensor-parallel replica holds shards; its weights cannot be "
                             "copied out whole")
        return pack_tensors(self.engine.weights.host_copy())

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self.engine.shutdown()


def pack_tensors(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
                 ) -> Packed:
    """Tensors as numpy bytes: Ray stores numpy arrays in its object store without pickling
    them, and a reader maps them without a copy (for 538 MB: 0.3 s to put and none to get,
    against 0.8-1.3 s and 0.6 s as torch tensors)."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    packed = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        packed.append((name, dtype_to_str(tensor.dtype), tuple(tensor.shape),
                       flat.view(torch.uint8).numpy()))
    return packed


def unpack_tensors(packed: Packed) -> list[tuple[str, torch.Tensor]]:
    """The tensors of pack_tensors, read-only views of the object store's memory."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [(name, torch.from_numpy(data).view(str_to_dtype(dtype)).view(shape))
                for name, dtype, shape, data in packed]
