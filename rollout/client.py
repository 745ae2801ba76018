"""TokenClient: token ids in, token ids out, always with logprobs and one weight version per token.

Works over an in-process `Engine` or a `RemoteEngine` (anything with the Engine's `generate`).
A sample that comes back aborted because someone paused generation for a weight update
(finish_reason["reason"] == "paused") is resubmitted from prompt + tokens so far with the
remaining budget (as AReaL does); the tokens it already has keep the versions that produced them.
The client records every version it sees (`versions`), the order lags are counted in.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hotswap.engine.request_builder import message_images
from hotswap.rollout.trajectory import extend_routes
from hotswap.weight_sync.versions import VersionOrder

# Abort reasons (the engine's ABORT_REASONS) that mean "a pause or a weight update interrupted
# you", not "you were cancelled".
RESUBMIT_REASONS = ("paused",)


@dataclass
class Completion:
    """One sample: generated ids with their behaviour logprobs and per-token weight versions."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[str | None]
    finish_reason: dict[str, Any]
    cached_tokens: int = 0
    resubmits: int = 0
    text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # TokenClient(routed_experts=True): [prompt + output - 1, moe_layers, top_k], see docs/moe.md
    routed_experts: np.ndarray | None = None
    # Speculative engines: verify steps and the drafted tokens they kept (meta_info's spec_*)
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    # Prompts with images: the expanded prompt ids the model saw (one placeholder run per image)
    # and per image {"grid_thw", "hash", "offset", "tokens"} (meta_info's prompt_ids, images)
    prompt_ids: list[int] | None = None
    image_meta: list[dict[str, Any]] = field(default_factory=list)

    @property
    def finish_type(self) -> str:
        return self.finish_reason.get("type", "abort")


def row_images(row: dict) -> list[Any] | None:
    """A row's images in prompt order: its "image_data" list, else the image parts of its
    messages ({"type": "image", "image": ...} or {"type": "image_url", "image_url": {"url"}},
    read as the engine reads them); None when it has none."""
    if row.get("image_data") is not None:
        return list(row["image_data"]) or None
    return message_images(row.get("messages") or []) or None


def versions_per_token(spans: list[dict], count: int) -> list[str | None]:
    """Turn the engine's `weight_versions` spans into one version per output position."""
    out: list[str | None] = [None] * count
    for span in spans:
        for i in range(max(0, span["start"]), min(count, span["end"])):
            out[i] = span["version"]
    return out


class TokenClient:
    def __init__(self, backend: Any, sampling: dict | None = None, tokenizer: Any = None,
                 max_resubmits: int = 16, routed_experts: bool = False):
        """backend: Engine or RemoteEngine. tokenizer: needed for text/messages rows when the
        backend has none (a RemoteEngine): a tokenizer object or a path for AutoTokenizer.
        routed_experts: ask an MoE engine for every token's experts (routing replay)."""
        if not hasattr(backend, "generate"):
            raise ValueError("backend must be an Engine or RemoteEngine (has no generate())")
        self.backend = backend
        self.sampling = dict(sampling or {})
        for key in ("n", "stream"):
            if key in self.sampling:
                raise ValueError(f"sampling[{key!r}] is set per call by the rollout, not here")
        self._tokenizer = tokenizer
        self.max_resubmits = max_resubmits
        self.routed_experts = routed_experts
        self.cancelled = threading.Event()  # set by collect()/AsyncRollout to stop resubmitting
        self.stats = {"requests": 0, "resubmits": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "completion_tokens": 0, "spec_verify_steps": 0, "spec_accepted_tokens": 0}
        self._lock = threading.Lock()
        self._rids = itertools.count()
        self._prefix = f"tc{id(self):x}"
        self.inflight: set[str] = set()
        self.versions = VersionOrder()  # every version this client (and its siblings) saw

    def sibling(self) -> TokenClient:
        """A client on the same backend, sampling, tokenizer and stats, cancelled on its own."""
        tokenizer = self.tokenizer if isinstance(self._tokenizer, str) else self._tokenizer
        other = TokenClient(self.backend, self.sampling, tokenizer, self.max_resubmits,
                            self.routed_experts)
        other.stats, other._lock, other.versions = self.stats, self._lock, self.versions
        return other

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = getattr(self.backend, "tokenizer", None)
        elif isinstance(self._tokenizer, str):
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer)
        if self._tokenizer is None:
            raise ValueError("tokenizer: this backend has none; pass TokenClient(tokenizer=...)")
        return self._tokenizer

    def weight_version(self) -> str:
        """The engine's version now (recorded in `versions`)."""
        version = str(self.backend.get_weight_version())
        self.versions.served(version)
        return version

    def encode_row(self, row: dict) -> list[int]:
        """A row's prompt as ids: `input_ids`, `messages` (chat template) or `prompt` text."""
        if row.get("input_ids") is not None:
            ids = row["input_ids"]
        elif row.get("messages") is not None:
            ids = self.tokenizer.apply_chat_template(row["messages"], tokenize=True,
                                                     add_generation_prompt=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        elif row.get("prompt") is not None:
            ids = self.tokenizer.encode(row["prompt"])
        else:
            raise ValueError("row needs one of 'messages', 'prompt', 'input_ids'")
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("row: the prompt is empty")
        return ids

    def generate(self, prompt_ids: list[int] | list[list[int]], n: int = 1,
                 session_id: str | list[str | None] | None = None,
                 seeds: list[int] | None = None, image_data: list | None = None,
                 **sampling: Any) -> list[Completion]:
        """n samples of each prompt (one request per prompt: its prefill is shared), adjacent.
        session_id: per prompt, an open session of the backend (n must then be 1); seeds: per
        prompt, in place of a `seed`. image_data: the images of one prompt (a list), or for a
        list of prompts one entry per prompt (None or a list); the prompt holds one
        <|image_pad|> placeholder (or the expanded run) per image."""
        single = bool(prompt_ids) and isinstance(prompt_ids[0], int)
        prompts = [prompt_ids] if single else prompt_ids
        images = [image_data] if single else image_data
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"image_data: {len(images)} entries for {len(prompts)} prompts")
        params = {**self.sampling, **sampling, "n": n}
        per_prompt = [params] * len(prompts) if seeds is None else [
            {**params, "seed": seed} for seed in seeds]
        if self.cancelled.is_set():  # the rollout was called off before this request went out
            return [Completion([], [], [], {"type": "abort", "reason": "user",
                                            "message": "cancelled by the rollout"})
                    for _ in range(len(prompts) * n)]
        outs = self._call([list(p) for p in prompts], params if seeds is None else per_prompt,
                          session_id, images)
        comps = [self._completion(o) for o in outs]
        self._count(len(prompts), prompts, n, comps)
        for i, comp in enumerate(comps):
            comps[i] = self._finish_interrupted(prompts[i // n], comp, per_prompt[i // n],
                                                None if images is None else images[i // n])
        return comps

    def _call(self, prompts: list[list[int]], params: dict | list[dict],
              session_id: str | list[str | None] | None = None,
              images: list | None = None) -> list[dict]:
        rids = [f"{self._prefix}-{next(self._rids)}" for _ in prompts]
        with self._lock:
            self.inflight.update(rids)
        try:
            extra: dict[str, Any] = {"return_routed_experts": True} if self.routed_experts else {}
            if session_id is not None:
                extra["session_id"] = session_id
            if images is not None and any(images):  # text-only backends never see the argument
                extra["image_data"] = images
            outs = self.backend.generate(input_ids=prompts, sampling_params=params,
                                         return_logprob=True, rid=rids, **extra)
        finally:
            with self._lock:
                self.inflight.difference_update(rids)
        return [outs] if isinstance(outs, dict) else outs

    def abort_inflight(self) -> None:
        """Stop resubmitting and abort every request this client has in flight."""
        self.cancelled.set()
        with self._lock:
            rids = list(self.inflight)
        for rid in rids:
            self.backend.abort_request(rid=rid)

    def _completion(self, out: dict) -> Completion:
        meta = out["meta_info"]
        ids = list(out["output_ids"])
        logprobs = [float(lp) for lp, _ in meta.get("output_token_logprobs", [])]
        if len(logprobs) != len(ids):
            raise RuntimeError("the engine returned no logprob for some generated token")
        versions = versions_per_token(meta["weight_versions"], len(ids))
        self.versions.see(*{v for v in versions if v is not None})
        return Completion(ids, logprobs, versions, dict(meta["finish_reason"] or {"type": "abort"}),
                          cached_tokens=int(meta.get("cached_tokens", 0)), text=out["text"],
                          routed_experts=meta.get("routed_experts"),
                          spec_verify_ct=int(meta.get("spec_verify_ct", 0)),
                          spec_accepted_tokens=int(meta.get("spec_accepted_tokens", 0)),
                          prompt_ids=meta.get("prompt_ids"),
                          image_meta=list(meta.get("images", [])))

    def _finish_interrupted(self, prompt: list[int], comp: Completion, params: dict,
                            images: list | None = None) -> Completion:
        budget = int(params.get("max_new_tokens", 128))
        while self._should_resubmit(comp) and len(comp.output_ids) < budget:
            rest = {**params, "n": 1, "max_new_tokens": budget - len(comp.output_ids)}
            rest["min_new_tokens"] = max(0, rest.get("min_new_tokens", 0) - len(comp.output_ids))
            more = self._completion(self._call([prompt + comp.output_ids], rest,
                                               images=None if images is None else [images])[0])
            with self._lock:
                self.stats["resubmits"] += 1
                self.stats["completion_tokens"] += len(more.output_ids)
            comp = Completion(comp.output_ids + more.output_ids, comp.logprobs + more.logprobs,
                              comp.versions + more.versions, more.finish_reason,
                              comp.cached_tokens, comp.resubmits + 1, comp.text + more.text,
                              routed_experts=extend_routes(comp.routed_experts,
                                                           more.routed_experts),
                              spec_verify_ct=comp.spec_verify_ct + more.spec_verify_ct,
                              spec_accepted_tokens=(comp.spec_accepted_tokens
                                                    + more.spec_accepted_tokens),
                              prompt_ids=comp.prompt_ids, image_meta=comp.image_meta)
        if self._should_resubmit(comp):  # the budget ran out exactly at the interruption
            comp.finish_reason = {"type": "length", "matched": None, "message": None}
        return comp

    def _should_resubmit(self, comp: Completion) -> bool:
        return (comp.finish_type == "abort" and not self.cancelled.is_set()
                and comp.resubmits < self.max_resubmits
                and comp.finish_reason.get("reason") in RESUBMIT_REASONS)

    def _count(self, requests: int, prompts: list[list[int]], n: int,
               comps: list[Completion]) -> None:
        with self._lock:
            self.stats["requests"] += requests
            self.stats["prompt_tokens"] += sum(len(p) for p in prompts) * n
            self.stats["cached_tokens"] += sum(c.cached_tokens for c in comps)
            self.stats["completion_tokens"] += sum(len(c.output_ids) for c in comps)
            self.stats["spec_verify_steps"] += sum(c.spec_verify_ct for c in comps)
            self.stats["spec_accepted_tokens"] += sum(c.spec_accepted_tokens for c in comps)
