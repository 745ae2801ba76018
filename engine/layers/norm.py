from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op. In bf16/fp16 it computes in float32 and rounds once at the end, where
        # HF rounds the normalised input before the weight multiply (1 ulp apart at most).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
