"""ScheduleBatch: the rows of one step and the flat tensors built from them, once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.core.request import Req


@dataclass
class BatchRow:
    req: Req
    extend: int  # new tokens computed this step
    samples: bool  # the row's last new token samples the next output token
    # Speculative decoding: drafted tokens fed after the row's last token; every one of the
    # row's 1 + len(draft) positions samples (engine/speculative/verify.py)
    draft: list[int] = field(default_factory=list)
    # A learned draft's drafts drawn from its distribution (speculative/draft.py SampledDraft):
    # verified by the min(1, p/q) rule instead of the point-mass one
    sampled: Any = None

    @property
    def scored(self) -> int:
        """Rows of the forward's output that belong to a classify request's row: every new
        token of a per-token request, else the last token of its last chunk."""
        if self.req.scoring is not None and self.req.scoring.per_token:
            return self.extend
        return int(self.samples)


class ImageSpan(NamedTuple):
    """A row's new tokens that hold image tokens: the prompt's tokens start..end-1 of `req`,
    laid out from flat token row `row` (the encoder cache fills their embeddings)."""

    req: Req
    start: int
    end: int
    row: int


@dataclass
class ScheduleBatch:
    rows: list[BatchRow]
    forward_batch: ForwardBatch
    image_spans: list[ImageSpan] = field(default_factory=list)

    @property
    def sampling_rows(self) -> list[BatchRow]:
        return [row for row in self.rows if row.samples]

    @classmethod
    def build(cls, rows: list[BatchRow], device: torch.device) -> ScheduleBatch:
        """Rows must already hold KV slots for their new tokens (KVManager.alloc)."""
        ids: list[int] = []
        slots, prefix, extend, logits_idx, pool_rows = [], [], [], [], []
        imaged: list[ImageSpan] = []  # rows of prompts with images: their positions differ
        for row in rows:
            req = row.req
            start = req.kv_len - row.extend
            slots.append(req.kv_slots[start:])
            if req.images is not None:
                imaged.append(ImageSpan(req, start, req.kv_len, len(ids)))
            if row.draft:
                # A verify row runs as 1 + len(draft) one-token rows of the same request at
                # consecutive positions: every backend stores a layer's new K/V before any row
                # attends, so position j sees the drafts before it, and the step stays a
                # decode step (the fused CPU kernel) instead of a short extend.
                tokens = req.fill_ids[start:] + row.draft
                logits_idx.extend(range(len(ids), len(ids) + len(tokens)))
                ids.extend(tokens)
                prefix.extend(range(start, req.kv_len))
                extend.extend([1] * len(tokens))
                pool_rows.extend([req.req_pool_idx] * len(tokens))
                continue
            ids.extend(req.fill_ids[start: req.kv_len])
            prefix.append(start)
            extend.append(row.extend)
            pool_rows.append(req.req_pool_idx)
            if row.req.scoring is not None:
                logits_idx.extend(range(len(ids) - row.scored, len(ids)))
            elif row.samples:
                logits_idx.append(len(ids) - 1)
        fb = ForwardBatch.build(ids, torch.cat(slots), pool_rows, prefix, extend, logits_idx,
                                device=device)
        if imaged:
            fb.positions = _mrope_positions(fb.positions, imaged)
        return cls(rows, fb, [s for s in imaged if s.req.images.overlaps(s.start, s.end)])


def _mrope_positions(plain: torch.Tensor, spans: list[ImageSpan]) -> torch.Tensor:
    """The step's positions with those of prompts with images made M-RoPE ones
    (PromptImages.rope): plain [T] positions shifted where every stream agrees (decode rows:
    by the request's offset), else [3, T]."""
    ropes = [(s, s.req.images.rope(s.start, s.end)) for s in spans]
    if all(isinstance(r, int) for _, r in ropes):
        out = plain.clone()
        for s, shift in ropes:
            out[s.row: s.row + s.end - s.start] += shift
        return out
    out = plain.expand(3, -1).clone()
    for s, rope in ropes:
        n = s.end - s.start
        if isinstance(rope, int):
            out[:, s.row: s.row + n] += rope
        else:
            out[:, s.row: s.row + n] = rope.to(out.device)
    return out
