"""verl's rollout adapter over hotswap: what verl's workers and agent loops call.

Follows verl b178a3c (2026-01-29): verl/workers/rollout/base.py (`BaseRollout`: `resume(tags)`,
`update_weights(weights, **kwargs)`, `release()`; the registry `_ROLLOUT_REGISTRY`),
verl/workers/rollout/sglang_rollout/sglang_rollout.py (`ServerAdapter.update_weights`: buckets of
`update_weights_bucket_megabytes`, then `flush_cache`), .../async_sglang_server.py (`generate(
prompt_ids, sampling_params, request_id, image_data, video_data) -> TokenOutput`), and the worker
order in verl/workers/fsdp_workers.py:
resume(["weights"]) -> update_weights -> resume(["kv_cache"]).

    rollout: name: hotswap    (with `import hotswap.trainers_adapters.verl` in the worker)

When verl is importable, `register()` (run at import) adds ("hotswap", "async") to verl's rollout
registry, and `HotswapServerAdapter` subclasses verl's BaseRollout. Without verl, everything
still works with plain dicts and tensors. The buckets of one update are staged (generation held)
and commit as one version at the flush that verl sends after the last one.
Not here: multi-modal inputs, routed-expert replay, LoRA sync (`peft_config`).
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hotswap.engine import Engine as HotswapEngine

ROLLOUT_NAME = "hotswap"
DEFAULT_BUCKET_BYTES = 512 << 20

try:
    _base = importlib.import_module("verl.workers.rollout.base")
    _BaseRollout: type = _base.BaseRollout
except ImportError:  # verl absent: a plain base class
    _base = None
    _BaseRollout = object


@dataclass
class TokenOutput:
    """verl's TokenOutput fields (verl/workers/rollout/replica.py)."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    weight_version: str | None = None  # hotswap: the version that produced the last token


class HotswapServerAdapter(_BaseRollout):  # type: ignore[misc, valid-type]
    """verl's rollout interface; `engine=` is a hotswap Engine or RemoteEngine."""

    def __init__(self, config: Any = None, model_config: Any = None, device_mesh: Any = None,
                 *, engine: Any = None):
        # verl's BaseRollout.__init__ converts omegaconf configs; keep them as given instead.
        self.config = config
        self.model_config = model_config
        self.device_mesh = device_mesh
        if engine is None:
            path = _get(model_config, "local_path") or _get(model_config, "path")
            if path is None:
                raise ValueError("give engine= or a model_config with local_path")
            engine = HotswapEngine(path)
        self.engine = engine

    async def resume(self, tags: list[str]) -> None:
        _check(self.engine.resume_memory_occupation(list(tags)))

    async def release(self) -> None:
        _check(self.engine.release_memory_occupation(["kv_cache", "weights"]))

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator,
                             **kwargs: Any) -> None:
        """Buckets staged one by one, committed as one version by the final flush."""
        if kwargs.get("peft_config") is not None and not kwargs.get("base_sync_done", True):
            raise ValueError("LoRA weight sync (peft_config) is not supported")
        limit = self._bucket_bytes()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        async for name, tensor in _aiter(weights):
            if bucket and size + tensor.numel() * tensor.element_size() > limit:
                self._stage(bucket)
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
        if bucket:
            self._stage(bucket)
        _check(self.engine.flush_cache())

    def _stage(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        # SGLang's call: update_weights_from_tensor(named_tensors, load_format, flush_cache=False)
        _check(self.engine.update_weights_from_tensor(bucket, None, False, commit=False))

    def _bucket_bytes(self) -> int:
        ckpt = _get(self.config, "checkpoint_engine")
        megabytes = _get(ckpt, "update_weights_bucket_megabytes")
        return int(megabytes) << 20 if megabytes else DEFAULT_BUCKET_BYTES

    async def generate(self, prompt_ids: list[int] | torch.Tensor, sampling_params: dict[str, Any],
                       request_id: str, image_data: Any = None,
                       video_data: Any = None) -> Any:
        """Token in, token out, as verl's async SGLang server: `max_tokens` is accepted for
        `max_new_tokens`, and `logprobs` asks for the tokens' logprobs."""
        if image_data or video_data:
            raise ValueError("image_data / video_data are not supported")
        params = dict(sampling_params)
        if "max_tokens" in params and "max_new_tokens" not in params:
            params["max_new_tokens"] = params.pop("max_tokens")
        return_logprob = bool(params.pop("logprobs", False))
        ids = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
        out = await self.engine.async_generate(None, params, ids, return_logprob=return_logprob,
                                               rid=request_id)
        meta = out["meta_info"]
        log_probs = ([lp for lp, _ in meta["output_token_logprobs"]] if return_logprob
                     else None)
        reason = (meta.get("finish_reason") or {}).get("type")
        return _token_output(token_ids=list(out["output_ids"]), log_probs=log_probs,
                             stop_reason="aborted" if reason == "abort" else "completed",
                             num_preempted=meta.get("num_retractions"),
                             weight_version=meta.get("weight_version"))


def _token_output(**fields: Any) -> Any:
    """verl's TokenOutput when verl is importable (without our extra field), else ours."""
    try:
        replica = importlib.import_module("verl.workers.rollout.replica")
    except ImportError:
        return TokenOutput(**fields)
    fields.pop("weight_version")
    return replica.TokenOutput(**fields)


async def _aiter(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _get(obj: Any, key: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(key)
    return getattr(obj, key, None)


def _check(result: dict | None) -> None:
    if result is not None and not result.get("success", True):
        raise RuntimeError(result.get("message", "failed"))


def register() -> bool:
    """Adds ("hotswap", "async") to verl's rollout registry; False when verl is not importable."""
    if _base is None:
        return False
    _base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HotswapServerAdapter"
    return True


register()
