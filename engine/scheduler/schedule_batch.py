"""ScheduleBatch: the rows of one step and the flat tensors built from them, once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.core.request import Req


@dataclass
class BatchRow:
    req: Req
    extend: int  # new tokens computed this step
    samples: bool  # the row's last new token samples the next output token


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
        slots, prefix, extend, logits_idx = [], [], [], []
        for row in rows:
            req = row.req
            start = req.kv_len - row.extend
            ids.extend(req.fill_ids[start: req.kv_len])
            slots.append(req.kv_slots[start:])
            prefix.append(start)
            extend.append(row.extend)
            if row.samples:
                logits_idx.append(len(ids) - 1)
        fb = ForwardBatch.build(ids, torch.cat(slots), [r.req.req_pool_idx for r in rows],
                                prefix, extend, logits_idx, device=device)
        return cls(rows, fb)
