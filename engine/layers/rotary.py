"""Rotary position embedding (half-rotation layout, as HF Llama/Qwen) with a cos/sin cache."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from hotswap.engine.layers import cpu_kernels


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"config.json rope_scaling type {kind!r} is not supported "
                     "(supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None):
        super().__init__()
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            # Whole blocks of 64 positions: no vector tail in cos/sin, so a position's values
            # do not depend on the table's length (rollout/exact_forward.py builds its own).
            rows = -(-max_positions // 64) * 64
            freqs = torch.outer(torch.arange(rows, dtype=torch.float32), inv_freq)
        self.head_dim = head_dim
        # Plain attributes, not buffers: the cache stays float32 whatever dtype the model takes.
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The step's cos/sin, built once and used by every layer."""
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        cos, sin = self.cos[positions], self.sin[positions]
        if positions.device.type == "cpu" and dtype in cpu_kernels.DTYPES and \
                cpu_kernels.available():
            return Rope(cos, sin, fused=True)
        return Rope(cos[:, None, :].to(dtype), sin[:, None, :].to(dtype), fused=False)


class Rope(NamedTuple):
    """cos, sin of a step's positions: float32 [T, D/2] for the fused CPU kernel, else
    [T, 1, D/2] in the model's dtype."""

    cos: torch.Tensor
    sin: torch.Tensor
    fused: bool


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate x [T, H, D] (any heads: q and k together when adjacent). The fused kernel rotates
    x in place (in float32, rounding once) and returns it; torch ops return a new tensor."""
    if rope.fused:
        return cpu_kernels.rotary_(x, rope.cos, rope.sin)
    cos, sin = rope.cos, rope.sin
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out
