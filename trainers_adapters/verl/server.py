"""verl's rollout server actor over one hotswap Engine (verl 0.9.1).

Follows verl 0.9.1's server actors (workers/rollout/sglang_rollout/async_sglang_server.py,
`SGLangHttpServer`): the replica creates it as a named Ray actor (`hotswap_server_{replica}_{node}`)
and verl's agent loops call `generate(prompt_ids, sampling_params, request_id, image_data,
video_data) -> TokenOutput`; the replica and the checkpoint manager call `wake_up`, `sleep`,
`abort_all_requests`, `resume_generation`, `clear_kv_cache`, `release_kv_cache`,
`resume_kv_cache`, `set_global_steps`, `get_server_address` and the profiling calls. The training
worker's adapter (rollout.py) pushes weights through `stage_weights` / `commit_weights`.

It is `hotswap.fleet.EngineReplica` with those methods, async (Ray runs them on one event loop,
the blocking engine calls in threads), and it needs no verl to import: `TokenOutput` is verl's
when verl is importable. Every output reports the weight versions of its own tokens, so verl's
`min_global_steps`/`max_global_steps` are exact, not the server's last `set_global_steps`.
A vision-language model takes the agent loop's `image_data` (its images, PIL as verl's
processor gives them) with prompt ids that hold the processor's expanded image runs, or one
placeholder per image; video and audio are refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from hotswap.fleet.replica import EngineReplica
from hotswap.rollout.client import versions_per_token

logger = logging.getLogger(__name__)

# verl's sampling keys that hotswap takes under another name or as a request argument
_RENAMED = {"max_tokens": "max_new_tokens"}


@dataclass
class TokenOutput:
    """verl's TokenOutput (workers/rollout/replica.py) where verl is not installed."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerSettings:
    """What one server needs from verl's rollout config, as plain values (replica.py builds it)."""

    model_path: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    rollout_mode: str = "hybrid"  # verl's RolloutMode value: "hybrid" | "colocated" | "standalone"
    replica_rank: int = 0
    node_rank: int = 0
    free_cache_engine: bool = True
    prompt_length: int = 512
    response_length: int = 512
    logprob_mode: str = "processed"
    http_host: str = "127.0.0.1"
    visible_devices: tuple[str, str] | None = None  # (variable, value) set before the engine


class HotswapServer(EngineReplica):
    """The server actor verl's `HotswapReplica` starts; `ray.remote(HotswapServer)` makes it."""

    def __init__(self, settings: ServerSettings):
        if settings.visible_devices is not None:
            os.environ[settings.visible_devices[0]] = settings.visible_devices[1]
        super().__init__(settings.model_path, settings.engine_kwargs, http_port=0,
                         http_host=settings.http_host)
        self.settings = settings
        self.global_steps: int | None = None  # what verl last said the weights are

    async def ready(self) -> str:
        """Returns once the engine serves (the constructor ran): the weight version."""
        return self.engine.get_weight_version()

    # generation

    async def generate(self, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None) -> Any:
        if video_data or audio_data or mm_processor_kwargs:
            raise ValueError("hotswap takes images only: video, audio and mm_processor_kwargs "
                             "are refused")
        ids = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
        params, return_logprob = self._sampling(ids, sampling_params)
        images = {"image_data": list(image_data)} if image_data else {}
        out = await self.engine.async_generate(None, params, ids, return_logprob=return_logprob,
                                               **images)
        return self._token_output(out, return_logprob)

    def _sampling(self, ids: list[int], sampling_params: dict[str, Any]) -> tuple[dict, bool]:
        """verl's sampling dict as hotswap's; the token budget as verl's servers compute it."""
        params = {_RENAMED.get(k, k): v for k, v in sampling_params.items()}
        return_logprob = bool(params.pop("logprobs", False))
        if params.pop("prompt_logprobs", None) is not None:
            raise ValueError("prompt_logprobs (distillation teachers) are not supported")
        room = self.engine.config.context_length - len(ids) - 1
        if room < 0:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the context length "
                             f"({self.engine.config.context_length})")
        budget = params.get("max_new_tokens")
        if budget is None:
            s = self.settings
            budget = min(s.response_length, s.prompt_length + s.response_length - len(ids))
        params["max_new_tokens"] = max(0, min(int(budget), room))
        params.setdefault("logprob_mode", self.settings.logprob_mode)
        if params.get("top_k") == 0:
            params["top_k"] = -1
        return params, return_logprob

    def _token_output(self, out: dict, return_logprob: bool) -> Any:
        meta = out["meta_info"]
        token_ids = list(out["output_ids"])
        versions = versions_per_token(meta.get("weight_versions", []), len(token_ids))
        steps = [s for s in (_as_step(v) for v in versions) if s is not None]
        last = steps[-1] if steps else _as_step(meta.get("weight_version"))
        reason = (meta.get("finish_reason") or {}).get("type")
        fields = {
            "token_ids": token_ids,
            "log_probs": ([lp for lp, *_ in meta["output_token_logprobs"]] if return_logprob
                          else None),
            "stop_reason": "aborted" if reason == "abort" else "completed",
            "num_preempted": meta.get("num_retractions"),
            "extra_fields": {
                "global_steps": last if last is not None else self.global_steps,
                "min_global_steps": min(steps) if steps else last,
                "max_global_steps": max(steps) if steps else last,
                "hotswap_weight_versions": versions,
                "num_cached_tokens": meta.get("cached_tokens"),
            },
        }
        return _verl_token_output(fields)

    # what verl's replica and checkpoint manager call

    async def wake_up(self) -> None:
        mode = self.settings.rollout_mode
        if mode == "hybrid":  # as verl's SGLang server: a hybrid rollout wakes in update_weights
            raise ValueError("wake_up is not used in hybrid mode: the training worker's "
                             "update_weights resumes the weights, then the KV cache")
        await self._memory("resume", ["kv_cache", "weights"] if mode == "colocated"
                           else ["kv_cache"])
        await self.clear_kv_cache()

    async def sleep(self) -> None:
        if not self.settings.free_cache_engine:
            return
        standalone = self.settings.rollout_mode == "standalone"
        await self._memory("release", ["kv_cache"] if standalone else ["kv_cache", "weights"])

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Partial rollout: unfinished requests return with stop_reason "aborted" and the tokens
        they have; new ones wait for resume_generation."""
        if reject_request:
            logger.warning("hotswap holds requests that arrive while paused until "
                           "resume_generation; reject_request=True is not honoured")
        await self._engine_call("pause_generation", "abort")
        await asyncio.to_thread(self.engine.abort_request, None, True)

    async def resume_generation(self) -> None:
        await self._engine_call("continue_generation")

    async def clear_kv_cache(self) -> None:
        await self._engine_call("flush_cache")

    async def release_kv_cache(self) -> None:
        if self.settings.free_cache_engine:
            await self._memory("release", ["kv_cache"])

    async def resume_kv_cache(self) -> None:
        if self.settings.free_cache_engine:
            await self._memory("resume", ["kv_cache"])
            await self.clear_kv_cache()

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def get_server_address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    async def start_profile(self, **kwargs: Any) -> None:
        return None  # verl's profiler drives vLLM/SGLang's; hotswap has none to start

    async def stop_profile(self) -> None:
        return None

    # weights, from the training worker's adapter (rollout.py)

    async def resume_memory(self, tags: list[str]) -> None:
        await self._memory("resume", tags)

    async def release_memory(self, tags: list[str]) -> None:
        await self._memory("release", tags)

    async def stage_weights(self, named_tensors: list[tuple[str, Any]]) -> dict:
        """One bucket of the update: validated and written to the staged weights; generation
        is held until commit_weights or abort_weights."""
        return await asyncio.to_thread(self.engine.update_weights_from_tensor, named_tensors,
                                       None, False, commit=False)

    async def commit_weights(self, weight_version: str | None) -> dict:
        """The staged buckets become one version; verl's global step when it gave one (the
        first sync labels new weights "0", like the checkpoint: the engine retires the cache
        of the old weights all the same)."""
        out = await asyncio.to_thread(self.engine.commit_weight_update, weight_version)
        if out["success"]:
            self.global_steps = _as_step(out.get("weight_version", weight_version))
        return out

    async def abort_weights(self) -> dict:
        return await asyncio.to_thread(self.engine.abort_weight_update)

    async def get_weight_version(self) -> str:
        return self.engine.get_weight_version()

    async def _memory(self, action: str, tags: list[str]) -> None:
        await self._engine_call(f"{action}_memory_occupation", tags)

    async def _engine_call(self, method: str, *args: Any) -> dict:
        out = await asyncio.to_thread(getattr(self.engine, method), *args)
        if isinstance(out, dict) and not out.get("success", True):
            raise RuntimeError(f"{method}: {out.get('message')}")
        return out


def _as_step(version: Any) -> int | None:
    """A hotswap version label as verl's global step (labels verl set are its steps)."""
    try:
        return int(version)
    except (TypeError, ValueError):
        return None


def _verl_token_output(fields: dict[str, Any]) -> Any:
    try:
        from verl.workers.rollout.replica import TokenOutput as VerlTokenOutput
    except ImportError:
        return TokenOutput(**fields)
    return VerlTokenOutput(**fields)
