"""Row-parallel projection: each rank multiplies its input columns, then the partial sums are
all-reduced. Wraps the model's own Linear, so weight maps, packing and LoRA see it unchanged."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class AllReducer(Protocol):
    def all_reduce(self, tensor: torch.Tensor) -> None: ...


class RowParallel(nn.Module):
    def __init__(self, inner: nn.Module, group: AllReducer):
        super().__init__()
        self.inner = inner
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x).contiguous()
        self.group.all_reduce(out)
        return out


def make_row_parallel(model: nn.Module, group: AllReducer) -> None:
    """Wraps every layer's o_proj and down_proj (their inputs are split over the ranks); a
    sparse MoE block all-reduces the sum of its experts' partial outputs itself."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        if hasattr(layer.mlp, "down_proj"):
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
        else:
            layer.mlp.all_reduce = group.all_reduce
