"""ScheduleBatch: the rows of one step and the flat tensors built from them, once."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    @property
    def scored(self) -> int:
        """Rows of the forward's output that belong to a classify request's row: every new
        token of a per-token request, else the last token of its last chunk."""
        if self.req.scoring is not None and self.req.scoring.per_token:
            return self.extend
        return int(self.samples)


@dataclass
class ScheduleBatch:
    rows: list[BatchRow]
    forward_batch: ForwardBatch

    @property
    def sampling_rows(self) -> list[BatchRow]:
        return [row for row in self.rows if row.samples]

    @classmethod
    def build(cls, rows: list[BatchRow], device: torch.device) -> ScheduleBatch:
        """Rows must already hold KV slots for their new tokens (KVManager.alloc)."""
        ids: list[int] = []
        slots, prefix, extend, logits_idx, pool_rows = [], [], [], [], []
        for row in rows:
            req = row.req
            start = req.kv_len - row.extend
            slots.append(req.kv_slots[start:])
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
        return cls(rows, fb)
