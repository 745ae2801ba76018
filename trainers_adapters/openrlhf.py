"""OpenRLHF 0.11.2's rollout actor (`RolloutRayActor`) over hotswap, and `create_vllm_engines`.

Follows OpenRLHF 0.11.2: openrlhf/trainer/ray/vllm_engine.py (`RolloutRayActor`, an async Ray
actor, and `create_vllm_engines`, which places one actor per engine in a placement group),
trainer/ray/ppo_actor.py (`_init_vllm_sync_group`: `init_process_group(addr, port,
i * tp + 1, world_size, "openrlhf", backend=, use_ray=)` on every engine while rank 0 builds its
side with `stateless_init_process_group`; `broadcast_to_vllm`: `reset_prefix_cache()`, then per
parameter `update_weight(name, dtype=, shape=, empty_cache=count == num_params)` beside the
broadcast), trainer/ppo_utils/samples_generator.py (`get_num_unfinished_requests`, then
`generate_responses(prompt=, label=, sampling_params=, max_length=, hf_tokenizer=, num_samples=)`),
trainer/ppo_trainer.py (`wake_up(tags=["weights"])` before a push, `sleep()` after sampling) and
ppo_trainer_async.py (`pause_generation` / `resume_generation` around a push).

    - from openrlhf.trainer.ray.vllm_engine import create_vllm_engines
    + from hotswap.trainers_adapters.openrlhf import create_vllm_engines
    - from openrlhf.utils.distributed_util import stateless_init_process_group
    + from hotswap.trainers_adapters.groups import stateless_init_process_group

Weights: every update_weight is staged (generation held) and the update commits as one version
at the last tensor (`empty_cache=True`) or at reset_prefix_cache(), whichever comes first.
`generate` is async and returns vLLM's `RequestOutput` shape; `generate_responses` runs
OpenRLHF's own agent executors (openrlhf.utils.agent) when OpenRLHF is installed, else a
single-turn executor with the same output fields.
Refused, with an error: `update_weight_cuda_ipc` (CUDA IPC handles), `use_ray=True` (Ray
collective groups), multi-modal inputs.
"""

from __future__ import annotations

import asyncio
from copy import deepcopy
from dataclasses import fields
from typing import Any

from hotswap.fleet.replica import EngineReplica
from hotswap.trainers_adapters.groups import STATELESS_GROUP_NAME
from hotswap.trainers_adapters.vllm import (
    LOGPROB_MODES,
    RequestOutput,
    SamplingParams,
    completion_output,
)

# vLLM engine arguments create_vllm_engines passes that mean nothing to hotswap
_VLLM_ONLY = frozenset({"enforce_eager", "worker_extension_cls", "distributed_executor_backend",
                        "trust_remote_code", "gpu_memory_utilization", "max_logprobs",
                        "num_gpus"})
def engine_options(kwargs: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    """vLLM's AsyncEngineArgs as create_vllm_engines fills them -> (model, Engine kwargs,
    logprob mode). `engine_kwargs` (hotswap's own options) goes last."""
    kwargs = dict(kwargs)
    model = kwargs.pop("model")
    options: dict[str, Any] = dict(kwargs.pop("engine_kwargs", None) or {})
    if kwargs.pop("limit_mm_per_prompt", None):
        raise ValueError("multi-modal prompts are not supported")
    mode = LOGPROB_MODES.get(kwargs.pop("logprobs_mode", None) or "processed_logprobs")
    if mode is None:
        raise ValueError("logprobs_mode: hotswap returns processed_logprobs or raw_logprobs")
    renamed = {"tensor_parallel_size": "tp_size", "max_model_len": "context_length",
               "enable_prefix_caching": "enable_prefix_cache", "seed": "seed", "dtype": "dtype",
               "enable_sleep_mode": "enable_weights_cpu_backup",
               "full_determinism": "deterministic", "max_num_seqs": "max_running_requests"}
    for key, value in kwargs.items():
        if key in renamed:
            if value is not None:
                options.setdefault(renamed[key], value)
        elif key not in _VLLM_ONLY:
            raise ValueError(f"vLLM engine argument {key!r} is not supported by hotswap")
    return model, options, mode


class HotswapRolloutActor(EngineReplica):
    """What OpenRLHF's trainer calls on a `RolloutRayActor`; `ray.remote(HotswapRolloutActor)`
    is the actor (create_vllm_engines below makes them as OpenRLHF does)."""

    def __init__(self, *args: Any, bundle_indices: list | None = None,
                 agent_func_path: str | None = None, remote_rm_url: Any = None,
                 mm_pad_token_ids: set | None = None, **kwargs: Any):
        if args:
            kwargs["model"] = args[0]
        model, options, self._logprob_mode = engine_options(kwargs)
        super().__init__(model, options)
        self._executor_args = (agent_func_path, remote_rm_url)
        self._executor: Any = None
        self._group: str | None = None
        self._released: set[str] = set()
        self._paused = False

    # weights (ppo_actor.py)

    async def init_process_group(self, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int, group_name: str, backend: str = "nccl",
                                 use_ray: bool = False) -> dict:
        if use_ray:
            raise ValueError("use_ray=True (Ray collective groups) is not supported; "
                             "set vllm.sync_with_ray off")
        if self._group is not None:
            await asyncio.to_thread(self.engine.destroy_weights_update_group, self._group)
        # The trainer's stateless group has no name; both sides use STATELESS_GROUP_NAME.
        out = await asyncio.to_thread(
            self.engine.init_weights_update_group, master_address, master_port, rank_offset,
            world_size, STATELESS_GROUP_NAME, "auto" if backend == "nccl" else backend)
        self._group = STATELESS_GROUP_NAME
        return out

    async def update_weight(self, name: str, dtype: Any, shape: Any,
                            empty_cache: bool = False) -> dict:
        if self._group is None:
            raise ValueError("call init_process_group first")
        # While paused for a partial rollout (vLLM's mode "keep"), running requests keep their
        # KV across the update; otherwise they are recomputed under the new weights.
        out = await asyncio.to_thread(
            self.engine.update_weights_from_distributed, [name],
            [str(dtype).removeprefix("torch.")], [list(shape)], self._group,
            commit=bool(empty_cache), pause_mode="in_place" if self._paused else "retract")
        if not out["success"]:
            raise RuntimeError(out["message"])
        return out

    async def update_weight_cuda_ipc(self, name: str, dtype: Any, shape: Any, ipc_handles: Any,
                                     empty_cache: bool = False) -> None:
        raise RuntimeError("CUDA IPC handles are not supported by hotswap: set "
                           "vllm.sync_backend to gloo, or leave train.colocate_all off")

    async def reset_prefix_cache(self) -> bool:
        """Commits a staged update, then drops the cached prefixes."""
        return bool((await asyncio.to_thread(self.engine.flush_cache))["success"])

    async def pause_generation(self) -> dict:
        self._paused = True
        return await asyncio.to_thread(self.engine.pause_generation, "in_place")  # vLLM "keep"

    async def resume_generation(self) -> dict:
        self._paused = False
        return await asyncio.to_thread(self.engine.continue_generation)

    async def sleep(self, level: int = 1) -> None:
        """Level 1 keeps a host copy of the weights when the engine was made with
        enable_sleep_mode (vLLM's offload); level 2, or without it, drops them: the next push
        must rewrite every tensor (OpenRLHF's always does)."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        tags = [t for t in ("kv_cache", "weights") if t not in self._released]
        if tags:
            _check(await asyncio.to_thread(self.engine.release_memory_occupation, tags))
            self._released.update(tags)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Resumes what sleep released of `tags` (None: everything), weights first."""
        wanted = [t for t in ("weights", "kv_cache") if t in (tags or ("weights", "kv_cache"))]
        for tag in wanted:
            if tag in self._released:
                _check(await asyncio.to_thread(self.engine.resume_memory_occupation, [tag]))
                self._released.discard(tag)

    # generation (samples_generator.py, openrlhf.utils.agent)

    async def generate(self, prompt_token_ids: list[int], sampling_params: Any,
                       multi_modal_data: Any = None) -> RequestOutput:
        """One request, vLLM's RequestOutput shape (`.outputs[0].token_ids/.text/
        .finish_reason/.logprobs`), each output with the version of its last token."""
        if multi_modal_data:
            raise ValueError("multi_modal_data is not supported")
        params = as_sampling_params(sampling_params)
        sampling = {**params.to_hotswap(), "logprob_mode": self._logprob_mode}
        outs = await self.engine.async_generate(None, sampling, list(prompt_token_ids),
                                                return_logprob=True,
                                                top_logprobs_num=params.logprobs or 0)
        outs = outs if isinstance(outs, list) else [outs]
        return RequestOutput(request_id=outs[0]["meta_info"]["id"], prompt=None,
                             prompt_token_ids=list(prompt_token_ids),
                             outputs=[completion_output(i, o, params) for i, o in enumerate(outs)])

    def get_num_unfinished_requests(self) -> int:
        counts = self.engine.get_load()
        return counts["running"] + counts["waiting"] + counts["forked"] + counts["compiling"]

    async def generate_responses(self, prompt: str, label: Any, sampling_params: Any,
                                 max_length: int, hf_tokenizer: Any, num_samples: int = 1,
                                 images: Any = None) -> list[dict]:
        """N samples of one prompt, each through the agent executor (as RolloutRayActor)."""
        executor = self._agent_executor()
        return await asyncio.gather(*[
            executor.execute(prompt=prompt, label=label, sampling_params=sampling_params,
                             max_length=max_length, hf_tokenizer=hf_tokenizer, llm_engine=self,
                             images=images)
            for _ in range(num_samples)])

    def _agent_executor(self) -> Any:
        if self._executor is None:
            self._executor = agent_executor(*self._executor_args)
        return self._executor

    def get_weight_version(self) -> str:
        return self.engine.get_weight_version()

    def shutdown(self) -> None:
        if self._group is not None:
            self.engine.destroy_weights_update_group(self._group)
        super().shutdown()


def as_sampling_params(params: Any) -> SamplingParams:
    """vLLM's SamplingParams (or ours, or a dict) as ours."""
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        return SamplingParams(**params)
    known = {f.name for f in fields(SamplingParams)} - {"extra"}
    return SamplingParams(**{k: getattr(params, k) for k in known if hasattr(params, k)})


def agent_executor(agent_func_path: str | None, remote_rm_url: Any) -> Any:
    """OpenRLHF's executor, as RolloutRayActor picks it; without OpenRLHF, single turn."""
    try:
        from openrlhf.utils import agent
    except ImportError:
        if agent_func_path or remote_rm_url:
            raise ImportError("agent_func_path and remote_rm_url need OpenRLHF installed") from None
        return SingleTurnExecutor()
    if agent_func_path:
        import importlib.util

        spec = importlib.util.spec_from_file_location("agent_module", agent_func_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.AgentExecutor()
    return agent.SingleTurnAgentExecutor(remote_rm_url)


class SingleTurnExecutor:
    """OpenRLHF's SingleTurnAgentExecutor without rewards, for when OpenRLHF is not installed:
    the same output fields."""

    async def execute(self, prompt: str, label: Any, sampling_params: Any, max_length: int,
                      hf_tokenizer: Any, llm_engine: Any, images: Any = None) -> dict:
        if images:
            raise ValueError("images are not supported")
        ids = hf_tokenizer(text=prompt, add_special_tokens=False)["input_ids"]
        params = deepcopy(sampling_params)
        if params.max_tokens is None:
            params.max_tokens = max(1, max_length - len(ids))
        ids = ids[-(max_length - params.max_tokens):]
        out = (await llm_engine.generate(ids, deepcopy(params))).outputs[0]
        logprobs = None
        if sampling_params.logprobs is not None and out.logprobs is not None:
            logprobs = [0.0] * len(ids) + [
                entry[t].logprob if t in entry else 0.0 for t, entry in zip(out.token_ids,
                                                                            out.logprobs)]
        return {"prompt": prompt, "label": label, "images": images, "mm_train_inputs": None,
                "observation_tokens": ids + out.token_ids,
                "action_ranges": [(len(ids), len(ids) + len(out.token_ids))],
                "rollout_log_probs": logprobs, "truncated": out.finish_reason == "length",
                "reward": None, "scores": None, "extra_logs": {}}


def create_vllm_engines(num_engines: int, tensor_parallel_size: int, pretrain: str, seed: int,
                        full_determinism: bool, enable_prefix_caching: bool,
                        enforce_eager: bool, max_model_len: int, shared_pg: Any = None,
                        gpu_memory_utilization: float | None = None,
                        vllm_enable_sleep: bool = False, logprobs_mode: str | None = None,
                        agent_func_path: str | None = None, remote_rm_url: Any = None,
                        max_images_per_prompt: int = 0, *, dtype: str = "bfloat16",
                        engine_kwargs: dict | None = None) -> list[Any]:
    """OpenRLHF's create_vllm_engines with hotswap actors: the same signature, placement and
    actor arguments. Without GPUs in the Ray cluster, bundles and actors take CPUs instead.
    `dtype` (OpenRLHF always says bfloat16) and `engine_kwargs` are hotswap's additions."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if max_images_per_prompt > 0:
        raise ValueError("multi-modal prompts are not supported")
    device = "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"
    hybrid = shared_pg is not None
    share = 0.2 if hybrid and tensor_parallel_size == 1 else 1  # two engines share a GPU
    if not hybrid:
        bundle = {"GPU": 1, "CPU": 1} if device == "GPU" else {"CPU": 1}
        shared_pg = placement_group([dict(bundle) for _ in range(num_engines
                                                                 * tensor_parallel_size)],
                                    strategy="PACK")
        ray.get(shared_pg.ready())
    actor_cls = ray.remote(HotswapRolloutActor)
    engines = []
    for i in range(num_engines):
        first = i * tensor_parallel_size if tensor_parallel_size > 1 else i
        resources = ({"num_gpus": share, "num_cpus": share} if device == "GPU"
                     else {"num_cpus": share})
        engines.append(actor_cls.options(
            **resources, max_concurrency=1000,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=shared_pg, placement_group_capture_child_tasks=True,
                placement_group_bundle_index=first),
        ).remote(
            model=pretrain, enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
            seed=seed + i, max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            dtype=dtype, trust_remote_code=True, full_determinism=full_determinism,
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=vllm_enable_sleep,
            logprobs_mode=logprobs_mode, agent_func_path=agent_func_path,
            remote_rm_url=remote_rm_url, engine_kwargs=engine_kwargs))
    if vllm_enable_sleep:
        ray.get([engine.sleep.remote() for engine in engines])
    return engines


def _check(result: dict) -> None:
    if not result.get("success", True):
        raise RuntimeError(result.get("message", "failed"))
