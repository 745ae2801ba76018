"""`vllm.LLM`, `SamplingParams`, `RequestOutput` for the calls RL trainers make, over hotswap.

Follows the vLLM (0.10-0.11 V1 `LLM`) call sites of TRL 1.16.0 (trl/generation/vllm_generation.py,
colocate mode: `LLM.generate([{"prompt_token_ids": ...}], sampling_params=..., use_tqdm=False)`,
`reset_prefix_cache`, `sleep(level)`, `wake_up(tags)`) and OpenRLHF 3c3be62
(openrlhf/trainer/ray/vllm_engine.py: token prompts, `reset_prefix_cache`, `sleep`/`wake_up`).

    - from vllm import LLM, SamplingParams
    + from hotswap.trainers_adapters.vllm import LLM, SamplingParams

Weights: `load_weights(pairs)` stages tensors (generation held) and `reset_prefix_cache()`
commits them as one version. `sleep(level)` releases weights and KV; with
`enable_sleep_mode=True` a host copy of the weights is kept and restored at `wake_up` (vLLM's
level 1 offload), so after either level generation works at once; trainers that push weights
after a level-2 sleep (TRL) overwrite them as usual.
Images (vision-language models): a token prompt's `multi_modal_data={"image": image or [images]}`
goes to hotswap's image_data; other modalities are refused.
Not here: `llm.llm_engine` internals, `collective_rpc`, LoRARequest objects, beam search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hotswap.engine import Engine as HotswapEngine

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# vLLM's logprobs_mode names -> hotswap's logprob_mode (the two vLLM modes hotswap returns)
LOGPROB_MODES = {"processed_logprobs": "processed", "raw_logprobs": "raw"}


@dataclass
class SamplingParams:
    """vLLM's sampling fields that map onto hotswap's; `logprobs=k` returns the sampled token's
    logprob plus the top k (vLLM's shape)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_hotswap(self) -> dict[str, Any]:
        params: dict[str, Any] = dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, max_new_tokens=16 if self.max_tokens is None else self.max_tokens,
            min_new_tokens=self.min_tokens, seed=self.seed, stop=self.stop or None,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias)
        regex = _structured_regex(self.structured_outputs)
        if regex is not None:
            params["regex"] = regex
        return {k: v for k, v in params.items() if v is not None}


def _structured_regex(structured: Any) -> str | None:
    if structured is None:
        return None
    regex = structured.get("regex") if isinstance(structured, dict) else getattr(
        structured, "regex", None)
    if regex is None:
        raise ValueError("structured_outputs: only regex is supported here")
    return regex


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_version: str | None = None  # hotswap: the version that produced the last token


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: Any = None


class LLM:
    """vLLM's offline `LLM` over a hotswap Engine (`engine=` wraps an existing one)."""

    def __init__(self, model: str | None = None, *, engine: Any = None, dtype: str = "auto",
                 seed: int = 0, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enable_sleep_mode: bool = False,
                 max_num_seqs: int | None = None, **ignored: Any):
        """`tensor_parallel_size` becomes the Engine's tp_size (it spawns its own workers);
        `ignored`: vLLM's other placement and memory options (gpu_memory_utilization,
        distributed_executor_backend, ...), which mean nothing here."""
        if engine is None:
            if model is None:
                raise ValueError("model is required")
            kwargs: dict[str, Any] = dict(seed=seed, enable_prefix_cache=enable_prefix_caching,
                                          context_length=max_model_len,
                                          enable_weights_cpu_backup=enable_sleep_mode)
            if dtype != "auto":
                kwargs["dtype"] = dtype
            if max_num_seqs is not None:
                kwargs["max_running_requests"] = max_num_seqs
            kwargs["tp_size"] = ignored.get("tensor_parallel_size", 1)
            engine = HotswapEngine(model, **kwargs)
        self.engine = engine

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = True, lora_request: Any = None,
                 **unsupported: Any) -> list[RequestOutput]:
        if lora_request is not None or unsupported:
            raise ValueError(f"not supported: {sorted(unsupported) or ['lora_request']}")
        items = prompts if isinstance(prompts, list) else [prompts]
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params or SamplingParams()] * len(items))
        if len(params) != len(items):
            raise ValueError("sampling_params: one per prompt, or a single one")
        ids = [_prompt_ids(p, self.engine.tokenizer) for p in items]
        images = [_prompt_images(p) for p in items]
        extra = {"image_data": images} if any(images) else {}
        outs = self.engine.generate(
            None, [p.to_hotswap() for p in params], ids, return_logprob=True,
            top_logprobs_num=max((p.logprobs or 0) for p in params), **extra)
        outs = outs if isinstance(outs, list) else [outs]
        results, k = [], 0
        for item, prompt_ids, p in zip(items, ids, params):
            samples = outs[k:k + p.n]
            k += p.n
            results.append(RequestOutput(
                request_id=samples[0]["meta_info"]["id"].rsplit("-", 1)[0] if p.n > 1
                else samples[0]["meta_info"]["id"], prompt=item if isinstance(item, str) else None,
                prompt_token_ids=prompt_ids,
                outputs=[completion_output(i, o, p) for i, o in enumerate(samples)]))
        return results

    def reset_prefix_cache(self) -> bool:
        """Commits staged weights (load_weights) as one version, then drops cached prefixes."""
        return bool(self.engine.flush_cache()["success"])

    def load_weights(self, weights: Any) -> None:
        """Stage (name, tensor) pairs; reset_prefix_cache() commits them."""
        pairs = list(weights.items() if isinstance(weights, dict) else weights)
        result = self.engine.update_weights_from_tensor(pairs, commit=False)
        if not result["success"]:
            raise RuntimeError(result["message"])

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        _check(self.engine.release_memory_occupation(None))

    def wake_up(self, tags: list[str] | None = None) -> None:
        _check(self.engine.resume_memory_occupation(tags))

    def get_weight_version(self) -> str:
        return self.engine.get_weight_version()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _check(result: dict) -> None:
    if not result.get("success", True):
        raise RuntimeError(result.get("message", "failed"))


def _prompt_ids(prompt: Any, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return list(tokenizer.encode(prompt["prompt"]))
    raise ValueError("a prompt is a str, {'prompt_token_ids': [...]} or {'prompt': str}")


def _prompt_images(prompt: Any) -> list[Any] | None:
    """A prompt's multi_modal_data images ({"image": one image or a list}); None without."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    if not data:
        return None
    if set(data) - {"image"}:
        raise ValueError(f"multi_modal_data: only 'image' is supported, not "
                         f"{sorted(set(data) - {'image'})}")
    images = data["image"]
    return list(images) if isinstance(images, (list, tuple)) else [images]


def completion_output(index: int, out: dict, params: SamplingParams) -> CompletionOutput:
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    logprobs = None
    if params.logprobs is not None:
        tops = meta.get("output_top_logprobs") or [[] for _ in pairs]
        logprobs = []
        for (lp, tid), top in zip(pairs, tops):
            entry = {tid: Logprob(lp, rank=None)}
            for rank, (tlp, ttid) in enumerate(top[: params.logprobs], start=1):
                entry.setdefault(ttid, Logprob(tlp, rank=rank))
            logprobs.append(entry)
    reason = meta["finish_reason"] or {}
    cumulative = sum(lp for lp, _ in pairs) if pairs else None
    return CompletionOutput(
        index=index, text=out["text"], token_ids=list(out["output_ids"]),
        cumulative_logprob=cumulative if cumulative is None or math.isfinite(cumulative)
        else None, logprobs=logprobs, finish_reason=_FINISH.get(reason.get("type")),
        stop_reason=reason.get("matched"), weight_version=meta.get("weight_version"))
