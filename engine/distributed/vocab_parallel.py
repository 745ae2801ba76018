"""Vocab-parallel embedding and logits: each rank holds a contiguous block of vocabulary rows.

The embedding looks up the ids that fall in this rank's block (zeros for the others) and
all-reduces, so exactly one rank contributes each row and the sum is exact. The lm_head of each
rank yields the logits of its block; rank 0 gathers the blocks and drops the padding columns.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class AllReducer(Protocol):
    def all_reduce(self, tensor: torch.Tensor) -> None: ...


class Gatherer(Protocol):
    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None: ...


class VocabParallelEmbedding(nn.Module):
    """Wraps the model's own Embedding (its weight is this rank's rows), so weight maps see it
    unchanged."""

    def __init__(self, inner: nn.Embedding, start: int, group: AllReducer):
        super().__init__()
        self.inner, self.start, self.group = inner, start, group

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.inner.num_embeddings)
        x = self.inner(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0)
        self.group.all_reduce(x)
        return x


def make_vocab_parallel(model: nn.Module, tp_rank: int, group: AllReducer) -> None:
    embed = model.model.embed_tokens
    model.model.embed_tokens = VocabParallelEmbedding(embed, tp_rank * embed.num_embeddings, group)


def gather_logits(local: torch.Tensor, vocab_size: int, group: Gatherer) -> torch.Tensor:
    """Rank 0: the full [n, vocab_size] logits from every rank's [n, rows] block; other ranks
    send theirs and get their own block back (unused)."""
    rows = local.shape[-1]
    if local.shape[0] == 0:  # every rank sees the same batch, so all skip the collective
        return local.new_empty((0, vocab_size))
    blocks = group.gather(local.contiguous())
    if blocks is None:
        return local
    # The padding columns sit at the end: trim each block to its real columns, then one cat.
    real = [max(0, min(rows, vocab_size - r * rows)) for r in range(len(blocks))]
    return torch.cat([b[:, :n] for b, n in zip(blocks, real, strict=True) if n], dim=-1)
