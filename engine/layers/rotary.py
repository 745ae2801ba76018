"""Rotary position embedding (half-rotation layout, as HF Llama/Qwen) with a cos/sin cache, and
M-RoPE (Qwen2.5-VL, Qwen3-VL): three position streams (t, h, w), each rotating its own share of
the frequencies."""

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
        return self.lookup_at(positions, slice(None), positions.device, dtype)

    def lookup_at(self, rows: torch.Tensor, columns: torch.Tensor | slice,
                  device: torch.device, dtype: torch.dtype) -> Rope:
        """cos/sin of table entries [rows, columns] (a position per row, or per row and
        frequency)."""
        if self.cos.device != device:
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return make_rope(self.cos[rows, columns], self.sin[rows, columns], dtype)


def make_rope(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> Rope:
    """A Rope of float32 cos/sin [T, D/2] for x of `dtype`: the fused kernel's where it runs."""
    if cos.device.type == "cpu" and dtype in cpu_kernels.DTYPES and cpu_kernels.available():
        return Rope(cos.contiguous(), sin.contiguous(), fused=True)
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


def mrope_streams(head_dim: int, section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """The position stream (0 = t, 1 = h, 2 = w) of each of the head_dim/2 frequencies: in
    consecutive runs of section[0], section[1], section[2] (Qwen2.5-VL), or interleaved t, h, w,
    t, h, w, ... with h and w up to 3 * section[1|2] and t for the rest (Qwen3-VL)."""
    half = head_dim // 2
    if sum(section) != half or len(section) != 3:
        raise ValueError(f"config.json mrope_section {list(section)} must be three numbers "
                         f"summing to head_dim/2 = {half}")
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    streams = torch.zeros(half, dtype=torch.int64)
    for stream in (1, 2):
        streams[stream: 3 * section[stream]: 3] = stream
    return streams


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding over M-RoPE positions [3, T] (an image's tokens and the prompt around
    it); plain positions [T] (text, decode: every stream at position + the request's offset)
    read the table as RotaryEmbedding does, so the fused decode kernel still applies."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, section: tuple[int, ...], interleaved: bool):
        super().__init__(head_dim, max_positions, theta, scaling)
        with torch.device("cpu"):  # plain attributes, like the table (the model is built on meta)
            self.streams = mrope_streams(head_dim, section, interleaved)
            self.columns = torch.arange(head_dim // 2)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        if positions.dim() == 1:
            return super().lookup(positions, dtype)
        if self.streams.device != positions.device:
            self.streams = self.streams.to(positions.device)
            self.columns = self.columns.to(positions.device)
        # frequency j of token i rotates by the position of stream streams[j]
        rows = positions[self.streams].T
        return super().lookup_at(rows, self.columns, positions.device, dtype)


class MRopePositions(NamedTuple):
    """A prompt's M-RoPE positions (HF's get_rope_index) and its decode offset (rope_deltas):
    token i >= len(prompt) sits at i + delta on every stream."""

    prompt: torch.Tensor  # [3, len(prompt)] int64
    delta: int

    def span(self, start: int, end: int) -> torch.Tensor:
        """Positions [3, end - start] of tokens start..end-1 (a prefill chunk, decode steps)."""
        inside = self.prompt[:, start: min(end, self.prompt.shape[1])]
        after = torch.arange(max(start, self.prompt.shape[1]), max(end, self.prompt.shape[1]))
        after += self.delta
        return torch.cat((inside, after.expand(3, -1)), dim=1)


def mrope_positions(ids: list[int], grids: list[tuple[int, int, int]], image_token_id: int,
                    merge: int) -> MRopePositions:
    """M-RoPE positions of an expanded prompt: text runs count on from the last position on all
    three streams; an image's run of t*h*w/merge^2 tokens takes (start + t, start + row, start
    + col) over its merged grid, and the text after it starts at start + max(rows, cols)."""
    streams, pos, i, image = [], 0, 0, 0
    while i < len(ids):
        j = i
        while j < len(ids) and (ids[j] == image_token_id) == (ids[i] == image_token_id):
            j += 1
        if ids[i] != image_token_id:
            streams.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos, i = pos + j - i, j
            continue
        if image == len(grids):
            raise ValueError(f"the prompt has more image placeholder runs than the {len(grids)} "
                             "image(s)")
        t, h, w = grids[image]
        h, w = h // merge, w // merge
        if t * h * w > j - i:
            raise ValueError(f"image {image}: a run of {j - i} placeholder tokens, expected "
                             f"{t * h * w} (expand_image_tokens)")
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                          indexing="ij")).reshape(3, -1)
        streams.append(grid + pos)
        pos, i, image = pos + max(h, w), i + t * h * w, image + 1
    if image != len(grids):
        raise ValueError(f"the prompt has placeholders for {image} of {len(grids)} image(s)")
    prompt = torch.cat(streams, dim=1) if streams else torch.zeros(3, 0, dtype=torch.int64)
    return MRopePositions(prompt, int(prompt.max()) + 1 - len(ids) if len(ids) else 0)
