"""Rotary position embedding (half-rotation layout, as HF Llama/Qwen) with a cos/sin cache."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


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
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.head_dim = head_dim
        # Plain attributes, not buffers: the cache stays float32 whatever dtype the model takes.
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] for a step's positions: built once, used by every layer."""
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        return (self.cos[positions][:, None, :].to(dtype),
                self.sin[positions][:, None, :].to(dtype))


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x [T, H, D] (any heads: q and k together when adjacent) into a new tensor."""
    cos, sin = cos_sin
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out
