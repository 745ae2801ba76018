"""`sglang.Engine` with SGLang's signatures, defaults and output shapes, over hotswap's Engine.

Follows SGLang 0.5.x `sglang.srt.entrypoints.engine.Engine` as its RL callers use it: verl
b178a3c (2026-01-29: workers/rollout/sglang_rollout, `sgl_update_weights` per bucket with
flush_cache=False, then flush_cache) and slime 624b824 (2026-08-21: backends/sglang_utils).

    - import sglang as sgl; engine = sgl.Engine(model_path=...)
    + from hotswap.trainers_adapters import sglang as sgl; engine = sgl.Engine(model_path=...)

Differences that a caller can see:
- update calls with flush_cache=False are staged (generation held) and commit as one version at
  the next call with flush_cache=True, at flush_cache(), or at continue_generation().
- weight methods return SGLang's `(success, message)`; logprob entries are
  `(logprob, token_id, text | None)` as SGLang's.
- image_data goes to hotswap's image_data (vision-language models: one placeholder or the
  expanded run per image in input_ids; any image form SGLang takes that is local: PIL images,
  bytes, base64, data: URLs, paths; nothing is fetched).
- SGLang features with no counterpart here (custom logit processors, token_ids_logprob,
  CUDA-IPC `LocalSerializedTensor` payloads) raise ValueError naming them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from hotswap.engine import Engine as HotswapEngine
from hotswap.engine.server.sglang_compat import translate_sampling

# SGLang ServerArgs -> hotswap Engine arguments.
_SERVER_ARGS = {"model_path": "model_path", "dtype": "dtype", "device": "device",
                "random_seed": "seed", "mem_fraction_static": "mem_fraction",
                "max_running_requests": "max_running_requests",
                "chunked_prefill_size": "chunked_prefill_size", "page_size": "page_size",
                "context_length": "context_length", "schedule_policy": "schedule_policy",
                "attention_backend": "attention_backend", "max_total_tokens": "max_total_tokens",
                "enable_weights_cpu_backup": "enable_weights_cpu_backup",
                "enable_deterministic_inference": "deterministic", "tp_size": "tp_size"}
# ServerArgs that change logging or loading only; accepted so verl's and slime's configs start.
_IGNORED_ARGS = ("log_level", "trust_remote_code", "skip_server_warmup", "load_format",
                 "enable_memory_saver", "port", "host", "base_gpu_id", "gpu_id_step", "nnodes",
                 "node_rank", "dist_init_addr", "tokenizer_path", "mm_attention_backend")


class Engine:
    """SGLang's Engine API; `engine=` wraps an existing hotswap Engine or RemoteEngine."""

    def __init__(self, *, engine: Any = None, **server_args: Any):
        if engine is None:
            engine = HotswapEngine(**_engine_kwargs(server_args))
        elif server_args:
            raise ValueError("give engine= or server arguments, not both")
        self.engine = engine
        self.tokenizer_manager = None  # SGLang internals are not reachable here

    # generation

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 image_data: Any = None, return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                 token_ids_logprob: Any = None, lora_path: str | list[str] | None = None,
                 custom_logit_processor: Any = None, return_hidden_states: bool = False,
                 stream: bool = False, rid: str | list[str] | None = None,
                 return_routed_experts: bool = False, **unsupported: Any) -> dict | list[dict]:
        kwargs, no_stop_trim = self._kwargs(locals())
        if stream:
            return (_shape(o, no_stop_trim) for o in self.engine.generate(**kwargs))
        return _shape_all(self.engine.generate(**kwargs), no_stop_trim)

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None,
                             image_data: Any = None, return_logprob: bool | list[bool] = False,
                             logprob_start_len: int | None = None,
                             top_logprobs_num: int | None = None, token_ids_logprob: Any = None,
                             lora_path: str | list[str] | None = None,
                             custom_logit_processor: Any = None,
                             return_hidden_states: bool = False, stream: bool = False,
                             rid: str | list[str] | None = None,
                             return_routed_experts: bool = False,
                             **unsupported: Any) -> dict | list[dict]:
        kwargs, no_stop_trim = self._kwargs(locals())
        if stream:
            raise ValueError("stream: use generate(stream=True) or hotswap's async_generate")
        out = await self.engine.async_generate(**kwargs)
        return _shape_all(out, no_stop_trim)

    def _kwargs(self, args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        unsupported = dict(args.pop("unsupported"))
        for name in ("token_ids_logprob", "custom_logit_processor"):
            if args[name] is not None:
                unsupported[name] = args[name]
        if args["return_hidden_states"]:
            unsupported["return_hidden_states"] = True
        if unsupported:
            raise ValueError(f"not supported by hotswap: {', '.join(sorted(unsupported))}")
        params = copy.deepcopy(args["sampling_params"])
        no_stop_trim = any([translate_sampling(p) for p in _as_list(params) if p is not None])
        return_logprob = args["return_logprob"]
        if isinstance(return_logprob, list):
            return_logprob = any(return_logprob)
        kwargs = dict(prompt=args["prompt"], sampling_params=params, input_ids=args["input_ids"],
                      return_logprob=bool(return_logprob),
                      top_logprobs_num=args["top_logprobs_num"] or 0,
                      lora_name=args["lora_path"], rid=args["rid"], stream=args["stream"],
                      return_routed_experts=args["return_routed_experts"])
        if args["image_data"] is not None:
            kwargs["image_data"] = args["image_data"]
        return kwargs, no_stop_trim

    # weights

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        tensors = unpack_named_tensors(named_tensors, load_format)
        result = self.engine.update_weights_from_tensor(tensors, None, flush_cache,
                                                        commit=flush_cache)
        return result["success"], result["message"]

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None
                                 ) -> tuple[bool, str]:
        result = self.engine.update_weights_from_disk(model_path, load_format)
        return result["success"], result["message"]

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> tuple[bool, str]:
        result = self.engine.init_weights_update_group(master_address, master_port, rank_offset,
                                                       world_size, group_name, backend)
        return result["success"], result["message"]

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True,
                                        load_format: str | None = None) -> tuple[bool, str]:
        result = self.engine.update_weights_from_distributed(
            list(names), [str(d).removeprefix("torch.") for d in dtypes],
            [list(s) for s in shapes], group_name, flush_cache, load_format,
            commit=flush_cache)
        return result["success"], result["message"]

    def destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                     ) -> tuple[bool, str]:
        result = self.engine.destroy_weights_update_group(group_name)
        return result["success"], result["message"]

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self.engine.get_weights_by_name(name, truncate_size)

    def flush_cache(self) -> dict:
        """Commits a staged update (SGLang trainers end a bucketed update with it)."""
        return self.engine.flush_cache()

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.engine.resume_memory_occupation(tags)

    def pause_generation(self, mode: str = "abort") -> dict:
        # SGLang's default mode aborts in-flight requests; "retract" and "in_place" as hotswap.
        return self.engine.pause_generation(mode)

    def continue_generation(self) -> dict:
        return self.engine.continue_generation()

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.engine.abort_request(rid or None, abort_all)

    def get_weight_version(self) -> str:
        return self.engine.get_weight_version()

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        return self.engine.update_weight_version(new_version, abort_all_requests)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def unpack_named_tensors(named_tensors: Any, load_format: str | None
                         ) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from SGLang's payloads: pairs, a dict, or (load_format
    "flattened_bucket") {"flattened_tensor", "metadata"} as slime's FlattenedTensorBucket."""
    if load_format == "flattened_bucket":
        return _unflatten(named_tensors)
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format {load_format!r} is not supported (CUDA IPC handles and "
                         "custom loaders need SGLang's model runner)")
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    pairs = [(name, tensor) for name, tensor in items]
    for name, tensor in pairs:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name!r}: expected a tensor, got {type(tensor).__name__} "
                             "(SGLang's LocalSerializedTensor carries CUDA IPC handles)")
    return pairs


def _unflatten(bucket: Any) -> list[tuple[str, torch.Tensor]]:
    flat = _field(bucket, "flattened_tensor")
    out = []
    for meta in _field(bucket, "metadata"):
        start, end = _field(meta, "start_idx"), _field(meta, "end_idx")
        view = flat[start:end].view(_field(meta, "dtype")).reshape(tuple(_field(meta, "shape")))
        out.append((_field(meta, "name"), view))
    return out


def _field(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


def _engine_kwargs(server_args: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    unknown = []
    for key, value in server_args.items():
        if key in _SERVER_ARGS:
            kwargs[_SERVER_ARGS[key]] = value
        elif key == "disable_radix_cache":
            kwargs["enable_prefix_cache"] = not value
        elif key not in _IGNORED_ARGS:
            unknown.append(key)
    if unknown:
        raise ValueError(f"SGLang server argument(s) not supported by hotswap: {sorted(unknown)}")
    if "model_path" not in kwargs:
        raise ValueError("model_path is required")
    if kwargs.get("dtype") == "auto":
        kwargs.pop("dtype")
    return kwargs


def _as_list(x: Any) -> list:
    return x if isinstance(x, list) else [x]


def _shape_all(out: dict | list[dict], no_stop_trim: bool) -> dict | list[dict]:
    if isinstance(out, list):
        return [_shape(o, no_stop_trim) for o in out]
    return _shape(out, no_stop_trim)


def _shape(out: dict, no_stop_trim: bool) -> dict:
    """SGLang's logprob tuples (logprob, id, None) and untrimmed stop strings when asked."""
    meta = out["meta_info"]
    reason = meta.get("finish_reason") or {}
    if no_stop_trim and reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
        out["text"] += reason["matched"]
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs"] = [(lp, t, None) for lp, t in meta["output_token_logprobs"]]
    if "output_top_logprobs" in meta:
        meta["output_top_logprobs"] = [[(lp, t, None) for lp, t in top]
                                       for top in meta["output_top_logprobs"]]
    return out
