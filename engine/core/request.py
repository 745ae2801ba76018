"""Req: one (prompt, sample) from admission to finish, and its incremental detokenizer.

The scheduler owns every Req. Fields fall into three groups: what was asked (ids, sampling),
what the KV cache holds for it (row, slots, tree lock), and what it returns (tokens, logprobs,
weight-version spans).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hotswap.engine.core.namespace import Namespace
from hotswap.engine.core.sampling_params import SamplingParams


class PrefixLock(Protocol):
    """The radix-tree node whose lock pins a request's borrowed prefix (kvcache's TreeNode).
    Declared here because kvcache imports core: core never imports kvcache."""

    lock_ref: int


# Why a request was aborted: finish_reason["reason"] (docs/api.md#outputs). Clients act on
# these (TokenClient resubmits "paused" samples), never on the message, which is for people.
ABORT_REASONS = (
    "user",  # abort_request, or its client left
    "paused",  # a pause or a weight update with mode "abort": the tokens are sound, resubmit
    "adapter_replaced",  # its LoRA adapter was replaced under pause mode "abort"
    "adapter_unloaded",  # its LoRA adapter was unloaded
    "relabelled",  # update_weight_version(abort_all_requests=True)
    "update_failed",  # a weight update failed after writing: the weights are incomplete
    "grammar",  # its grammar did not compile, or refused every token
    "non_finite",  # the model produced NaN or inf logits
    "undelivered",  # its output could not be delivered (the consumer is gone)
    "error",  # an internal error in the step that ran it
    "shutdown",  # the engine shut down
)


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    message: str | None = None
    reason: str | None = None  # an abort's: one of ABORT_REASONS

    @classmethod
    def aborted(cls, reason: str, message: str) -> FinishReason:
        if reason not in ABORT_REASONS:
            raise ValueError(f"abort reason {reason!r} is not one of {ABORT_REASONS}")
        return cls("abort", message=message, reason=reason)

    def to_dict(self) -> dict[str, Any]:
        out = {"type": self.type, "matched": self.matched, "message": self.message}
        if self.type == "abort":
            out["reason"] = self.reason
        return out


@dataclass
class VersionSpan:
    version: str
    start: int
    end: int
    adapter_version: int | None = None  # the LoRA adapter's version, for adapter requests


@dataclass(frozen=True)
class Scoring:
    """What a classify request asks of its prompt's hidden states (docs/api.md#scoring)."""

    activation: bool = False  # sigmoid for one class, softmax over several; False: raw values
    per_token: bool = False  # every position's scores, not only the last token's
    step_tag_id: int | None = None  # per-token rows only at positions holding this token
    returned_ids: tuple[int, ...] | None = None  # the classes kept, in this order

    def finish(self, scores: torch.Tensor) -> torch.Tensor:
        """Rows of raw scores [n, num_labels] as returned: classes picked, activation applied."""
        if self.returned_ids is not None:
            scores = scores[:, list(self.returned_ids)]
        if not self.activation:
            return scores
        return scores.sigmoid() if scores.shape[-1] == 1 else scores.softmax(-1)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas; holds back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def update(self, ids: list[int]) -> str:
        """Decode up to the end of `ids`; returns the newly final text."""
        prefix = self.tokenizer.decode(ids[self.prefix_offset: self.read_offset],
                                       skip_special_tokens=self.skip_special)
        full = self.tokenizer.decode(ids[self.prefix_offset:],
                                     skip_special_tokens=self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self.text += delta
        return delta


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    cache_salt: str | None = None
    lora_name: str | None = None
    session_id: str | None = None  # its KV stays pinned after it finishes (scheduler/sessions.py)
    stream: bool = False
    sink: Callable[[dict[str, Any]], None] | None = None  # receives output events
    group_leader: Req | None = None  # n > 1: siblings wait for the leader's prompt KV
    grammar: Any = None  # grammar.manager.RequestGrammar: this sample's compile job and matcher
    created: float = field(default_factory=time.perf_counter)
    # A vision-language prompt's images (multimodal/prompt_images.py PromptImages): their
    # pixels, runs in prompt_ids, M-RoPE positions and the prompt's cache keys; None: text
    images: Any = None

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[list[float | int]]] = field(default_factory=list)
    version_spans: list[VersionSpan] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_retractions: int = 0
    cached_tokens: int = 0
    cached_from_host: int = 0  # of cached_tokens, copied back from the HiCache host tier
    cached_from_storage: int = 0  # ... and read from the HiCache storage tier
    # return_routed_experts: [positions, moe_layers, top_k] int16, the routing of every token
    # fed so far; kept from before a retraction (the positions then computed), completed from
    # the KV pool when the request finishes
    routed_experts: torch.Tensor | None = None
    # A classify request (a reward model): prefill only; its scores are the last token's
    # [num_labels] float32 row and, for per-token requests, every computed chunk's rows.
    scoring: Scoring | None = None
    scores: torch.Tensor | None = None
    scored_version: str | None = None  # the weight version that computed them
    token_scores: list[torch.Tensor] = field(default_factory=list)

    # KV state, owned by the scheduler
    namespace: Namespace | None = None
    req_pool_idx: int | None = None
    kv_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    tree_prefix_len: int = 0  # leading kv_slots owned by the radix tree (locked via last_node)
    last_node: PrefixLock | None = None
    prefill_done: bool = False
    admit_seq: int = 0
    detok: IncrementalDetokenizer | None = None
    # Speculative decoding (engine/speculative/): the drafter's state for this request, and
    # how many verify steps it ran and how many drafted tokens they kept.
    spec_state: Any = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    stop_scan_from: int = 0
    streamed_ids: int = 0
    streamed_text: int = 0
    # Prefill/decode handoff (engine/kvcache/handoff.py). A prefill engine's request exports
    # its prompt's KV when it has sampled its first token (export_kv -> kv_export). A decode
    # engine's request brings KV to import before admission (handoff), pinned in the tree by
    # handoff_lock until admitted; handoff_result is what became of it, for the output.
    export_kv: bool = False
    kv_export: Any = None
    handoff: Any = None
    handoff_lock: PrefixLock | None = None
    handoff_result: dict[str, Any] | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs: prompt + generated so far."""
        return self.prompt_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """fill_ids as the prefix cache keys them: an image's tokens by the image's content."""
        if self.images is None:
            return self.fill_ids
        return list(self.images.keys) + self.output_ids

    @property
    def kv_len(self) -> int:
        return int(self.kv_slots.numel())

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))

    def stamp(self, version: str, adapter_version: int | None = None) -> None:
        """Record that the newest output token was produced by `version` (and, for a LoRA
        request, by `adapter_version` of its adapter)."""
        pos = len(self.output_ids) - 1
        last = self.version_spans[-1] if self.version_spans else None
        if last and (last.version, last.adapter_version) == (version, adapter_version):
            last.end = pos + 1
        else:
            self.version_spans.append(VersionSpan(version, pos, pos + 1, adapter_version))
