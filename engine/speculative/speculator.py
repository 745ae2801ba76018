"""Speculator: what the scheduler asks for drafts, and where it reports what they gave."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hotswap.engine.config import EngineConfig
from hotswap.engine.core.request import Req
from hotswap.engine.executor.model_runner import ModelRunner
from hotswap.engine.speculative.draft import LearnedDraft, SampledDraft
from hotswap.engine.speculative.lengths import DraftLengths
from hotswap.engine.speculative.ngram import NgramIndex
from hotswap.engine.speculative.self_draft import SelfDraft


class Speculator:
    def __init__(self, config: EngineConfig, runner: ModelRunner,
                 prepare_lora: Callable[[list[str | None], list[int]], Any], version: str):
        self.kind = config.speculative
        self.context_length = config.context_length
        self.lengths = DraftLengths(config.speculative_num_draft_tokens)
        self.self_draft = (SelfDraft(runner, config.speculative_self_layers, prepare_lora)
                           if self.kind == "self" else None)
        self.learned = LearnedDraft(runner, version) if self.kind == "draft" else None
        self.step_length = 0  # the length chosen for the current step

    def eligible(self, req: Req) -> bool:
        """Grammar-constrained requests do not speculate (their matcher would have to walk
        the drafts and back), nor requests that opted out, nor, with a learned draft, requests
        with adapters (the draft learned the base policy) or images."""
        if self.learned is not None and (req.lora_name is not None or req.images is not None):
            return False
        return req.params.speculative and req.grammar is None

    def plan(self, reqs: list[Req]) -> list[list[int]] | list[int]:
        """Before slots are given: n-gram drafts (lists of tokens) or, for model drafts, the
        length each request will draft once it holds its slots (ints); 0 / [] = no draft."""
        self.step_length = length = self.lengths.choose(len(reqs))
        sd = self.self_draft
        if sd is not None and sd.layers is None and not sd.calibrate(reqs):
            self.step_length = length = 0  # nothing to calibrate on yet
        if self.learned is not None and not self.learned.active:
            self.step_length = length = 0
        caps = [self._cap(req, length) for req in reqs]
        if self.kind != "ngram":
            return caps
        drafts = []
        for req, cap in zip(reqs, caps):
            if req.spec_state is None:
                req.spec_state = NgramIndex()
            drafts.append(req.spec_state.propose(req.fill_ids, cap) if cap else [])
        return drafts

    def _cap(self, req: Req, length: int) -> int:
        if not length or not self.eligible(req):
            return 0
        # no draft past the request's last token or the context (positions kv_len .. + length)
        room = min(req.remaining_new_tokens - 1, self.context_length - 1 - len(req.fill_ids))
        return max(0, min(length, room))

    def skip(self) -> None:
        """This step runs without drafts after all (the KV pool is short)."""
        self.step_length = 0

    def propose(self, reqs: list[Req], plan: list[list[int]] | list[int],
                generator: torch.Generator
                ) -> tuple[list[list[int]], list[SampledDraft | None]]:
        """Each request's drafted tokens, once it holds slots for them (`plan`: this step's
        plan()), and its sampled draft (None: point masses)."""
        if self.learned is not None:
            return self.learned.propose(reqs, plan, generator)
        if self.self_draft is not None:
            return self.self_draft.propose(reqs, plan), [None] * len(reqs)
        return plan, [None] * len(reqs)  # n-gram drafts: the plan is the drafts

    def record(self, batch: int, tokens: int, seconds: float) -> None:
        """A decode-only step of `batch` rows emitted `tokens` in `seconds`."""
        self.lengths.record(batch, self.step_length, tokens, seconds)

    def verified(self, drafted: int, kept: int) -> None:
        """A verify row kept `kept` of its `drafted` tokens."""
        if self.learned is not None:
            self.learned.verified(drafted, kept)

    def weights_served(self, version: str, written: set[str]) -> None:
        if self.learned is not None:
            self.learned.weights_served(version, written)

    def memory(self, release: bool) -> None:
        """The KV pool was released (or allocated again): a learned draft's KV and stored
        states go (come back) with it."""
        if self.learned is not None:
            self.learned.memory(release)

    def describe(self) -> dict[str, Any]:
        """The kind, the chosen draft length per batch-size bucket, and a learned draft's
        version, freshness and live acceptance."""
        out: dict[str, Any] = {"kind": self.kind, "lengths": self.lengths.table()}
        if self.learned is not None:
            out.update(self.learned.describe())
        return out
