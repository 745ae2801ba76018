"""LoRABatch: one step's adapter segments and the batched LoRA delta over them.

Tokens are grouped by adapter (a segment per adapter used in the step; tokens of base-model rows
belong to none) and padded to the longest segment, so each projection's delta is two batched
matmuls over all segments at once, whatever the number of rows:

    h = bmm(x[gather], A[slots]^T)   [segments, longest, targets * rank]
    y[tokens] += bmm(h, B[slots]^T)  per target, scattered back to the tokens' rows

A step with no adapter row gets no LoRABatch at all: the base path runs exactly as without LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotswap.engine.lora.pool import KINDS, LoRAPool


@dataclass
class LoRABatch:
    pool: LoRAPool
    slots: torch.Tensor | slice  # the step's pool slots, one per segment
    gather: torch.Tensor  # [segments, longest] token rows (padding repeats a valid row)
    tokens: torch.Tensor  # [N] token rows that use an adapter, in segment order
    flat: torch.Tensor  # [N] their positions in the flattened [segments * longest] output
    dense: bool  # one segment covering every token: no gather or scatter
    kinds: frozenset[str]  # projection kinds some adapter of the step targets

    @classmethod
    def build(cls, pool: LoRAPool, row_slots: list[int], extends: list[int],
              kinds: frozenset[str]) -> LoRABatch:
        """row_slots[i]: pool slot of row i's adapter, -1 for the base model."""
        tok_slot = torch.repeat_interleave(torch.tensor(row_slots), torch.tensor(extends))
        tokens = (tok_slot >= 0).nonzero().squeeze(1)
        uniq, seg, counts = torch.unique(tok_slot[tokens], return_inverse=True,
                                         return_counts=True)
        order = torch.argsort(seg, stable=True)
        tokens, seg = tokens[order], seg[order]
        starts = counts.cumsum(0) - counts
        pos = torch.arange(tokens.numel()) - starts[seg]
        longest = int(counts.max())
        gather = tokens[starts].unsqueeze(1).repeat(1, longest)
        gather[seg, pos] = tokens
        ids = uniq.tolist()
        contiguous = ids == list(range(ids[0], ids[0] + len(ids)))
        device = pool.device
        return cls(pool=pool,
                   slots=slice(ids[0], ids[-1] + 1) if contiguous else uniq.to(device),
                   gather=gather.to(device), tokens=tokens.to(device),
                   flat=(seg * longest + pos).to(device),
                   dense=len(ids) == 1 and tokens.numel() == tok_slot.numel(), kinds=kinds)

    def apply(self, layer: int, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add the LoRA delta of projection `kind` (input x, output y) to y in place."""
        if kind not in self.kinds:
            return y
        pool, rank = self.pool, self.pool.rank
        xs = x.unsqueeze(0) if self.dense else x[self.gather]
        h = torch.bmm(xs, pool.a[kind][self.slots, layer].transpose(1, 2))
        parts = [torch.bmm(h[..., i * rank: (i + 1) * rank],
                           pool.b[t][self.slots, layer].transpose(1, 2))
                 for i, t in enumerate(KINDS[kind])]
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if self.dense:
            return y.add_(delta[0])
        return y.index_add_(0, self.tokens, delta.flatten(0, 1)[self.flat])
