"""OpenRLHF's rollout actor (`LLMRayActor` + `WorkerWrap`) with its method names, over hotswap.

Follows OpenRLHF 3c3be62 (2026-08-13): openrlhf/trainer/ray/vllm_engine.py (the actor's methods)
and openrlhf/trainer/ray/ppo_actor.py (`_init_vllm_engines_actor_group`, `broadcast_to_vllm`):
the trainer calls `init_process_group(addr, port, i * tp + 1, world_size, "openrlhf",
backend=..., use_ray=False)` on every engine while it builds its own side with
`stateless_init_process_group(addr, port, 0, world_size, device)`; then for every parameter
`update_weight(name, dtype=..., shape=..., empty_cache=count == num_params)` while it broadcasts
that one tensor; `reset_prefix_cache()` when prefix caching is on.

    - from openrlhf.utils.distributed_util import stateless_init_process_group
    + from hotswap.trainers_adapters.groups import stateless_init_process_group
    and build the engines as `HotswapRolloutActor` (a Ray actor class where Ray is used).

One tensor per call, committed once: every update_weight is staged (generation held) and the
update commits as one version at the last tensor (`empty_cache=True`, which OpenRLHF sends with
the last parameter) or at reset_prefix_cache(), whichever comes first.
Not here: `update_weight_cuda_ipc` (CUDA IPC handles), `use_ray=True` (Ray collective groups).
"""

from __future__ import annotations

from typing import Any

from hotswap.engine import Engine as HotswapEngine
from hotswap.trainers_adapters.groups import STATELESS_GROUP_NAME
from hotswap.trainers_adapters.vllm import RequestOutput, SamplingParams, completion_output


class HotswapRolloutActor:
    """What OpenRLHF's trainer calls on a vLLM engine actor; `engine=` wraps an existing one."""

    def __init__(self, pretrain: str | None = None, *, engine: Any = None, **engine_kwargs: Any):
        self.engine = engine if engine is not None else HotswapEngine(pretrain, **engine_kwargs)
        self._group: str | None = None

    def init_process_group(self, master_address: str, master_port: int, rank_offset: int,
                           world_size: int, group_name: str, backend: str = "nccl",
                           use_ray: bool = False) -> dict:
        if use_ray:
            raise ValueError("use_ray=True (Ray collective groups) is not supported")
        if self._group is not None:
            self.engine.destroy_weights_update_group(self._group)
        # The trainer's stateless group has no name; both sides use STATELESS_GROUP_NAME.
        result = self.engine.init_weights_update_group(master_address, master_port, rank_offset,
                                                       world_size, STATELESS_GROUP_NAME,
                                                       "auto" if backend == "nccl" else backend)
        self._group = STATELESS_GROUP_NAME
        return result

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> dict:
        if self._group is None:
            raise ValueError("call init_process_group first")
        result = self.engine.update_weights_from_distributed(
            [name], [str(dtype).removeprefix("torch.")], [list(shape)], self._group,
            commit=bool(empty_cache))
        if not result["success"]:
            raise RuntimeError(result["message"])
        return result

    def update_weight_cuda_ipc(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("CUDA IPC handles are not supported by hotswap; use update_weight")

    def reset_prefix_cache(self) -> bool:
        """Commits a staged update, then drops the cached prefixes."""
        return bool(self.engine.flush_cache()["success"])

    def pause_generation(self) -> dict:
        return self.engine.pause_generation("in_place")  # vLLM's mode="keep"

    def resume_generation(self) -> dict:
        return self.engine.continue_generation()

    def sleep(self, level: int = 1) -> dict:
        return self.engine.release_memory_occupation(None)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        return self.engine.resume_memory_occupation(tags)

    def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams | dict,
                 multi_modal_data: Any = None) -> RequestOutput:
        if multi_modal_data:
            raise ValueError("multi_modal_data is not supported")
        params = (sampling_params if isinstance(sampling_params, SamplingParams)
                  else SamplingParams(**sampling_params))
        outs = self.engine.generate(None, params.to_hotswap(), list(prompt_token_ids),
                                    return_logprob=True, top_logprobs_num=params.logprobs or 0)
        outs = outs if isinstance(outs, list) else [outs]
        return RequestOutput(request_id=outs[0]["meta_info"]["id"], prompt=None,
                             prompt_token_ids=list(prompt_token_ids),
                             outputs=[completion_output(i, o, params) for i, o in enumerate(outs)])

    def get_num_unfinished_requests(self) -> int:
        load = getattr(self.engine, "get_load", None)
        if load is None:  # a client without an in-process scheduler: nothing is queued here
            return 0
        counts = load()
        return counts["running"] + counts["waiting"] + counts["forked"] + counts["compiling"]

    def get_weight_version(self) -> str:
        return self.engine.get_weight_version()

    def shutdown(self) -> None:
        if self._group is not None:
            self.engine.destroy_weights_update_group(self._group)
        self.engine.shutdown()
