"""ReplicaClient: an EngineReplica actor called like an Engine (docs/fleet.md#the-replica-actor).

One method per call the replica forwards (`FORWARDED`), made from EngineClient's (or
HandoffClient's) method so it has its signature; tests/fleet/test_ray_fleet.py checks that the
methods are exactly the forwarded set. Also the Ray helpers the fleet's modules share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from hotswap.engine import Engine
from hotswap.engine.client.protocol import EngineClient, HandoffClient
from hotswap.engine.client.request import GenerateRequest

F = TypeVar("F", bound=Callable[..., Any])


def ray_module() -> Any:
    """Ray, imported when a fleet needs it (it is the `ray` extra)."""
    try:
        import ray
    except ImportError as err:  # pragma: no cover - the extra is missing
        raise ImportError("RayFleet needs Ray: pip install 'hotswap[ray]'") from err
    return ray


def died(exc: BaseException) -> bool:
    """Whether `exc` says the actor is gone (rather than that its engine refused a call)."""
    ray = ray_module()
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                            ray.exceptions.ActorUnavailableError))


def unwrap(exc: BaseException) -> BaseException:
    """The engine's own exception out of Ray's wrapper (ValueError stays ValueError)."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray_module().exceptions.RayTaskError) and isinstance(cause, Exception):
        return cause
    return exc


def _forwarded(method: F) -> F:
    """The engine's method of the same name, called through EngineReplica.call: only the
    arguments given travel, so the engine's defaults apply."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: ReplicaClient, *args: Any, **kwargs: Any) -> Any:
        return self.get(self.actor.call.remote(name, *args, **kwargs))

    return call  # type: ignore[return-value]


class ReplicaClient:
    """Blocking calls on one replica actor that raise the engine's errors. Each `_forwarded`
    method is one engine call the actor forwards, with the interface's signature."""

    def __init__(self, actor: Any, ranks: int, label: str):
        self.actor, self.weight_sync_ranks, self.label = actor, ranks, label

    def __repr__(self) -> str:
        return self.label

    @staticmethod
    def get(ref: Any, timeout: float | None = None) -> Any:
        try:
            return ray_module().get(ref, timeout=timeout)
        except Exception as exc:
            raise unwrap(exc) from None

    # through the object store (EngineReplica's own methods)

    @property
    def weights_dtype(self) -> str:
        return self.get(self.actor.weights_dtype.remote())

    @property
    def model_name(self) -> str:
        return self.get(self.actor.info.remote())["model_name"]

    def prepare_tensors(self, packed: Any, model: str | None = None) -> dict:
        return self.get(self.actor.prepare_tensors.remote(packed, model))

    def update_tensors(self, packed: Any, *args: Any, **kwargs: Any) -> dict:
        return self.get(self.actor.update_tensors.remote(packed, *args, **kwargs))

    # scoring (RayFleet.classify: one replica scores a call)

    classify = _forwarded(EngineClient.classify)

    # serving state

    abort_request = _forwarded(EngineClient.abort_request)
    pause_generation = _forwarded(EngineClient.pause_generation)
    continue_generation = _forwarded(EngineClient.continue_generation)
    flush_cache = _forwarded(EngineClient.flush_cache)
    open_session = _forwarded(EngineClient.open_session)
    close_session = _forwarded(EngineClient.close_session)
    release_memory_occupation = _forwarded(EngineClient.release_memory_occupation)
    resume_memory_occupation = _forwarded(EngineClient.resume_memory_occupation)
    check_integrity = _forwarded(EngineClient.check_integrity)
    get_load = _forwarded(Engine.get_load)

    # weights: versions and one-call updates

    get_weight_version = _forwarded(EngineClient.get_weight_version)
    update_weight_version = _forwarded(EngineClient.update_weight_version)
    get_weights_by_name = _forwarded(EngineClient.get_weights_by_name)
    update_weights_from_tensor = _forwarded(EngineClient.update_weights_from_tensor)
    update_weights_from_serialized = _forwarded(EngineClient.update_weights_from_serialized)
    update_weights_from_disk = _forwarded(EngineClient.update_weights_from_disk)

    # weights: the open update transaction (staged, or prepared in two phases)

    prepare_weights_from_distributed = _forwarded(EngineClient.prepare_weights_from_distributed)
    prepare_weights_from_disk = _forwarded(EngineClient.prepare_weights_from_disk)
    commit_weight_update = _forwarded(EngineClient.commit_weight_update)
    abort_weight_update = _forwarded(EngineClient.abort_weight_update)

    # weights: a trainer's process group

    init_weights_update_group = _forwarded(EngineClient.init_weights_update_group)
    update_weights_from_distributed = _forwarded(EngineClient.update_weights_from_distributed)
    destroy_weights_update_group = _forwarded(EngineClient.destroy_weights_update_group)

    # LoRA adapters

    load_lora_adapter = _forwarded(EngineClient.load_lora_adapter)
    load_lora_adapter_from_tensors = _forwarded(EngineClient.load_lora_adapter_from_tensors)
    unload_lora_adapter = _forwarded(EngineClient.unload_lora_adapter)
    list_lora_adapters = _forwarded(EngineClient.list_lora_adapters)

    # the prefill/decode handoff (fleet/disagg.py)

    prefill = _forwarded(HandoffClient.prefill)
    generate_from_handoff = HandoffClient.generate_from_handoff

    def _generate_from_handoff(self, handoff: dict, request: GenerateRequest) -> Any:
        if not request.stream:
            return self.get(self.actor.call.remote("generate_from_handoff", handoff,
                                                   **request.body()))
        refs = self.actor.generate_from_handoff_stream.options(
            num_returns="streaming").remote(handoff, request.replace(stream=False).body())
        return (self.get(ref) for ref in refs)

    init_kv_transfer_group = _forwarded(HandoffClient.init_kv_transfer_group)
    send_kv_handoff = _forwarded(HandoffClient.send_kv_handoff)
    drop_kv_handoff = _forwarded(HandoffClient.drop_kv_handoff)
    destroy_kv_transfer_group = _forwarded(HandoffClient.destroy_kv_transfer_group)
