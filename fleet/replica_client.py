"""ReplicaClient: an EngineReplica actor called like an Engine (docs/fleet.md#the-replica-actor).

One method per call the replica forwards (`FORWARDED`), with EngineClient's signature, so a
call on a replica can be found and type-checked; tests/fleet/test_ray_fleet.py checks that the
methods are exactly the forwarded set. Also the Ray helpers the fleet's modules share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

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
    method is one engine call the actor forwards, declared with EngineClient's signature."""

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

    def prepare_tensors(self, packed: Any) -> dict:
        return self.get(self.actor.prepare_tensors.remote(packed))

    def update_tensors(self, packed: Any, *args: Any, **kwargs: Any) -> dict:
        return self.get(self.actor.update_tensors.remote(packed, *args, **kwargs))

    # serving state

    @_forwarded
    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None: ...

    @_forwarded
    def pause_generation(self, mode: str = "retract") -> dict: ...

    @_forwarded
    def continue_generation(self) -> dict: ...

    @_forwarded
    def flush_cache(self, timeout_s: float | None = None) -> dict: ...

    @_forwarded
    def open_session(self, ttl_s: float = 300.0, session_id: str | None = None) -> str: ...

    @_forwarded
    def close_session(self, session_id: str) -> bool: ...

    @_forwarded
    def release_memory_occupation(self, tags: list[str] | None = None) -> dict: ...

    @_forwarded
    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict: ...

    @_forwarded
    def check_integrity(self) -> None: ...

    @_forwarded
    def get_load(self) -> dict[str, Any]: ...

    # weights: versions and one-call updates

    @_forwarded
    def get_weight_version(self) -> str: ...

    @_forwarded
    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict: ...

    @_forwarded
    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list: ...

    @_forwarded
    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, *, weight_version: str | None = None,
                                   pause_mode: str = "retract",
                                   commit: bool | None = None) -> dict: ...

    @_forwarded
    def update_weights_from_serialized(self, serialized_named_tensors: list[str],
                                       load_format: str | None = None, flush_cache: bool = True,
                                       *, weight_version: str | None = None,
                                       pause_mode: str = "retract",
                                       commit: bool | None = None) -> dict: ...

    @_forwarded
    def update_weights_from_disk(self, model_path: str, load_format: str | None = None, *,
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 pause_mode: str = "retract",
                                 commit: bool | None = None) -> dict: ...

    # weights: the open update transaction (staged, or prepared in two phases)

    @_forwarded
    def prepare_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                         shapes: list[list[int]],
                                         group_name: str = "weight_update_group",
                                         load_format: str | None = None) -> dict: ...

    @_forwarded
    def prepare_weights_from_disk(self, model_path: str) -> dict: ...

    @_forwarded
    def commit_weight_update(self, weight_version: str | None = None,
                             pause_mode: str | None = None) -> dict: ...

    @_forwarded
    def abort_weight_update(self) -> dict: ...

    # weights: a trainer's process group

    @_forwarded
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "auto") -> dict: ...

    @_forwarded
    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True,
                                        load_format: str | None = None, *,
                                        weight_version: str | None = None,
                                        pause_mode: str = "retract",
                                        commit: bool | None = None,
                                        lora_name: str | None = None,
                                        staging: str | None = None) -> dict: ...

    @_forwarded
    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict: ...

    # LoRA adapters

    @_forwarded
    def load_lora_adapter(self, lora_name: str, lora_path: str, *,
                          pause_mode: str = "retract") -> dict: ...

    @_forwarded
    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict,
                                       *, pause_mode: str = "retract") -> dict: ...

    @_forwarded
    def unload_lora_adapter(self, lora_name: str) -> dict: ...

    @_forwarded
    def list_lora_adapters(self) -> dict[str, int]: ...

    # the prefill/decode handoff (fleet/disagg.py)

    @_forwarded
    def prefill(self, prompt: str | list[str] | None = None,
                sampling_params: dict | list[dict] | None = None,
                input_ids: list[int] | list[list[int]] | None = None, *,
                messages: list[dict] | list[list[dict]] | None = None,
                return_logprob: bool = False, top_logprobs_num: int = 0,
                lora_name: str | list[str] | None = None,
                cache_salt: str | list[str] | None = None, rid: str | list[str] | None = None,
                return_routed_experts: bool = False, transport: str = "auto") -> dict: ...

    def generate_from_handoff(self, handoff: dict, sampling_params: dict | None = None, *,
                              return_logprob: bool = False, top_logprobs_num: int = 0,
                              lora_name: str | None = None, cache_salt: str | None = None,
                              rid: str | None = None, stream: bool = False,
                              return_routed_experts: bool = False) -> Any:
        kwargs = {"sampling_params": sampling_params, "return_logprob": return_logprob,
                  "top_logprobs_num": top_logprobs_num, "lora_name": lora_name,
                  "cache_salt": cache_salt, "rid": rid,
                  "return_routed_experts": return_routed_experts}
        if not stream:
            return self.get(self.actor.call.remote("generate_from_handoff", handoff, **kwargs))
        refs = self.actor.generate_from_handoff_stream.options(
            num_returns="streaming").remote(handoff, kwargs)
        return (self.get(ref) for ref in refs)

    @_forwarded
    def init_kv_transfer_group(self, master_address: str, master_port: int, rank: int,
                               world_size: int, group_name: str = "kv_transfer",
                               backend: str = "auto") -> dict: ...

    @_forwarded
    def send_kv_handoff(self, handoff_id: str, dst_rank: int) -> dict: ...

    @_forwarded
    def drop_kv_handoff(self, handoff_id: str) -> bool: ...

    @_forwarded
    def destroy_kv_transfer_group(self) -> dict: ...
