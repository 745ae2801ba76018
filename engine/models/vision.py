"""Vision towers of Qwen2-VL, Qwen2.5-VL and Qwen3-VL (HF's `model.visual.*`), torch ops.

Patches arrive flattened, (C, T, P, P) per row, in spatial-merge-block order (the image
processor's layout: the merge x merge patches that become one language-model token are
adjacent). The tower embeds them (the Conv3d as a matmul), rotates q/k by each patch's (row,
col) in 2-D rotary, attends within blocks (an image, or Qwen2.5-VL's windows outside its
full-attention blocks), and the merger maps each merge x merge group to one token of the
language model's width. Qwen3-VL adds interpolated learned position embeddings and deepstack
features: the merged hidden states of some blocks, added to the language model's first layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.engine.config import ModelConfig
from hotswap.engine.layers.norm import RMSNorm
from hotswap.engine.layers.rotary import Rope, apply_rotary, make_rope

VISION_KINDS = {"Qwen2VLForConditionalGeneration": "qwen2_vl",
                "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
                "Qwen3VLForConditionalGeneration": "qwen3_vl"}
DEFAULT_ACT = {"qwen2_vl": "quick_gelu", "qwen2_5_vl": "silu", "qwen3_vl": "gelu_pytorch_tanh"}
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class VisionConfig:
    """config.json's vision_config, with HF's defaults for the fields a checkpoint may omit."""

    # "qwen2_vl" (LayerNorm, fc1/fc2 MLP), "qwen2_5_vl" (RMSNorm, gated MLP, windows) or
    # "qwen3_vl" (LayerNorm, linear_fc1/fc2 MLP, position table, deepstack)
    kind: str
    depth: int
    hidden_size: int  # the tower's width (Qwen2-VL's embed_dim)
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the language model's width
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    rope_theta: float
    window_size: int = 0  # Qwen2.5-VL: the attention window's side in pixels
    fullatt_block_indexes: tuple[int, ...] = ()
    num_position_embeddings: int = 0  # Qwen3-VL
    deepstack_visual_indexes: tuple[int, ...] = ()

    @classmethod
    def from_model(cls, cfg: ModelConfig) -> VisionConfig:
        v: dict[str, Any] = cfg.vision or {}
        kind = VISION_KINDS[cfg.architecture]
        act = v.get("hidden_act", DEFAULT_ACT[kind])
        if act not in ACTIVATIONS:
            raise ValueError(f"config.json vision_config.hidden_act {act!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        common = dict(kind=kind, depth=v.get("depth", 27 if kind == "qwen3_vl" else 32),
                      num_heads=v.get("num_heads", 16),
                      hidden_act=act, in_channels=v.get("in_channels", 3),
                      patch_size=v.get("patch_size", 16 if kind == "qwen3_vl" else 14),
                      temporal_patch_size=v.get("temporal_patch_size", 2),
                      spatial_merge_size=v.get("spatial_merge_size", 2),
                      rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 1e4)))
        if kind == "qwen2_vl":  # hidden_size names the output; the tower's width is embed_dim
            width = v.get("embed_dim", 1280)
            return cls(**common, hidden_size=width, intermediate_size=int(
                width * v.get("mlp_ratio", 4)), out_hidden_size=v.get("hidden_size", 3584))
        sizes = dict(hidden_size=v.get("hidden_size", 1152), out_hidden_size=v.get(
            "out_hidden_size", 3584), intermediate_size=v.get("intermediate_size", 4304))
        if kind == "qwen3_vl":
            return cls(**common, **sizes,
                       num_position_embeddings=v.get("num_position_embeddings", 2304),
                       deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes",
                                                            (8, 16, 24))))
        return cls(**common, **sizes, window_size=v.get("window_size", 112),
                   fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))))

    @property
    def qwen3(self) -> bool:
        return self.kind == "qwen3_vl"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


class VisionFeatures(NamedTuple):
    """The tower's output for a batch of images, one row per language-model token, images in
    order (image i holds t*h*w/merge^2 rows)."""

    embeds: torch.Tensor  # [tokens, out_hidden_size]
    deepstack: torch.Tensor | None  # [len(deepstack_visual_indexes), tokens, out_hidden_size]


def merge_order(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """A [h, w, ...] grid's cells in spatial-merge-block order, flattened to [h*w, ...]."""
    h, w = grid.shape[:2]
    blocks = grid.reshape(h // merge, merge, w // merge, merge, *grid.shape[2:])
    return blocks.transpose(1, 2).reshape(h * w, *grid.shape[2:])


def patch_coords(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, col) of every patch [N, 2], in the processor's order, every frame alike."""
    out = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        out.append(merge_order(torch.stack((rows, cols), dim=-1), merge).repeat(t, 1))
    return torch.cat(out)


def frame_bounds(grids: list[tuple[int, int, int]]) -> list[int]:
    """cu_seqlens of full attention: each frame of each image attends within itself."""
    bounds = [0]
    for t, h, w in grids:
        bounds += [bounds[-1] + h * w * (i + 1) for i in range(t)]
    return bounds


def window_order(grids: list[tuple[int, int, int]], merge: int, side: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the merged-token order that makes each window of side x side merged
    tokens (the last ones of a row or column smaller) contiguous, and their bounds in patches."""
    order, bounds, base = [], [0], 0
    for t, h, w in grids:
        mh, mw = h // merge, w // merge
        index = torch.arange(t * mh * mw).view(t, mh, mw) + base
        for frame in index:
            for r in range(0, mh, side):
                for c in range(0, mw, side):
                    cells = frame[r: r + side, c: c + side].reshape(-1)
                    order.append(cells)
                    bounds.append(bounds[-1] + len(cells) * merge * merge)
        base += t * mh * mw
    return torch.cat(order), bounds


def block_groups(bounds: list[int], device: torch.device) -> list[torch.Tensor]:
    """Blocks [bounds[i], bounds[i+1]) grouped by length: per length an index [blocks, length],
    so each group is one batched attention call."""
    by_len: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            by_len.setdefault(end - start, []).append(start)
    return [torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)
            for n, starts in by_len.items()]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    groups: list[torch.Tensor]) -> torch.Tensor:
    """Non-causal attention of q/k/v [N, H, D] within blocks (block-diagonal), with SDPA."""
    out = torch.empty_like(q)
    for index in groups:
        qs, ks, vs = (x[index].transpose(1, 2) for x in (q, k, v))  # [blocks, H, len, D]
        out[index] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, rope: Rope, groups: list[torch.Tensor]) -> torch.Tensor:
        qkv = self.qkv(x).view(len(x), 3 * self.heads, self.head_dim)
        qk = apply_rotary(qkv[:, : 2 * self.heads], rope)
        q, k = qk.split(self.heads, dim=1)
        o = block_attention(q, k, qkv[:, 2 * self.heads:], groups)
        return self.proj(o.reshape(len(x), -1))


class GatedMLP(nn.Module):
    """Qwen2.5-VL's block MLP: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """Qwen2-VL's and Qwen3-VL's block MLP: fc2(act(fc1(x))), under HF's names for each."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.names = ("linear_fc1", "linear_fc2") if cfg.qwen3 else ("fc1", "fc2")
        setattr(self, self.names[0], nn.Linear(cfg.hidden_size, cfg.intermediate_size))
        setattr(self, self.names[1], nn.Linear(cfg.intermediate_size, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = (getattr(self, name) for name in self.names)
        return fc2(self.act(fc1(x)))


def _norm(cfg: VisionConfig, size: int) -> nn.Module:
    return RMSNorm(size, 1e-6) if cfg.kind == "qwen2_5_vl" else nn.LayerNorm(size, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = _norm(cfg, cfg.hidden_size)
        self.norm2 = _norm(cfg, cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = GatedMLP(cfg) if cfg.kind == "qwen2_5_vl" else PlainMLP(cfg)

    def forward(self, x: torch.Tensor, rope: Rope, groups: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, groups)
        return x + self.mlp(self.norm2(x))


class Qwen2Merger(nn.Module):
    """Norm each patch, concatenate each merge group, then Linear-GELU-Linear (Qwen2-VL,
    Qwen2.5-VL)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge_unit
        self.ln_q = _norm(cfg, cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen3Merger(nn.Module):
    """LayerNorm each patch (or, for deepstack, each concatenated group), then fc-GELU-fc."""

    def __init__(self, cfg: VisionConfig, after_shuffle: bool):
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge_unit
        self.after_shuffle = after_shuffle
        self.norm = nn.LayerNorm(self.width if after_shuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.after_shuffle else \
            self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """`model.visual` of Qwen2.5-VL or Qwen3-VL; parameter names are HF's under that prefix."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        size = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, size, size,
                                          bias=cfg.qwen3)
        if cfg.qwen3:
            self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        if cfg.qwen3:
            self.merger = Qwen3Merger(cfg, after_shuffle=False)
            self.deepstack_merger_list = nn.ModuleList(
                Qwen3Merger(cfg, after_shuffle=True) for _ in cfg.deepstack_visual_indexes)
        else:
            self.merger = Qwen2Merger(cfg)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> VisionFeatures:
        """Features of images whose patches `pixels` [N, C*T*P*P] the processor made, grids
        their (t, h, w) in patches."""
        cfg, proj = self.cfg, self.patch_embed.proj
        weight = proj.weight.view(cfg.hidden_size, -1)
        x = F.linear(pixels.to(weight.dtype), weight, proj.bias)  # the Conv3d, one patch a row
        coords = patch_coords(grids, cfg.spatial_merge_size).to(x.device)
        if cfg.qwen3:
            x = x + self.position_table(grids).to(x.dtype)
            return self._qwen3_blocks(x, coords, grids)
        return self._qwen2_blocks(x, coords, grids)

    def rope(self, coords: torch.Tensor, dtype: torch.dtype) -> Rope:
        """2-D rotary: half of each head's frequencies turn with the row, half with the col."""
        quarter = self.cfg.head_dim // 4
        exps = torch.arange(0, 2 * quarter, 2, dtype=torch.float32, device=coords.device)
        inv_freq = 1.0 / (self.cfg.rope_theta ** (exps / (2 * quarter)))
        angles = (coords[..., None].float() * inv_freq).flatten(1)  # [N, rows | cols]
        return make_rope(angles.cos(), angles.sin(), dtype)

    def _qwen2_blocks(self, x: torch.Tensor, coords: torch.Tensor,
                      grids: list[tuple[int, int, int]]) -> VisionFeatures:
        """Qwen2-VL: every block attends over whole frames; Qwen2.5-VL: only the
        fullatt_block_indexes do, the others within windows (tokens reordered window by
        window, and the merged tokens back at the end)."""
        cfg = self.cfg
        full = block_groups(frame_bounds(grids), x.device)
        if not cfg.window_size:
            rope = self.rope(coords, x.dtype)
            for block in self.blocks:
                x = block(x, rope, full)
            return VisionFeatures(self.merger(x), None)
        side = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        order, window_bounds = window_order(grids, cfg.spatial_merge_size, side)
        order = order.to(x.device)
        patches = (order[:, None] * cfg.merge_unit + torch.arange(cfg.merge_unit,
                                                                  device=x.device)).flatten()
        x, coords = x[patches], coords[patches]
        rope = self.rope(coords, x.dtype)
        windows = block_groups(window_bounds, x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, full if i in cfg.fullatt_block_indexes else windows)
        tokens = self.merger(x)
        merged = torch.empty_like(tokens)
        merged[order] = tokens  # back to the processor's order
        return VisionFeatures(merged, None)

    def _qwen3_blocks(self, x: torch.Tensor, coords: torch.Tensor,
                      grids: list[tuple[int, int, int]]) -> VisionFeatures:
        cfg = self.cfg
        rope = self.rope(coords, x.dtype)
        full = block_groups(frame_bounds(grids), x.device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, full)
            if i in cfg.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return VisionFeatures(self.merger(x), torch.stack(deepstack) if deepstack else None)

    def position_table(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Qwen3-VL: the learned side x side position table, bilinearly resampled (corners
        aligned) to each image's h x w patches, in the processor's order [N, hidden]."""
        side = int(self.cfg.num_position_embeddings ** 0.5)
        table = self.pos_embed.weight.view(side, side, -1)
        out = []
        for t, h, w in grids:
            (r0, r1, fr), (c0, c1, fc) = _taps(h, side, table.device), _taps(w, side, table.device)
            fr, fc = fr[:, None, None], fc[None, :, None]
            grid = ((table[r0][:, c0] * ((1 - fr) * (1 - fc)) + table[r0][:, c1] * ((1 - fr) * fc))
                    + (table[r1][:, c0] * (fr * (1 - fc)) + table[r1][:, c1] * (fr * fc)))
            out.append(merge_order(grid, self.cfg.spatial_merge_size).repeat(t, 1))
        return torch.cat(out)

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter by its HF name (under `model.visual.`)."""
        return {f"model.visual.{name}": p for name, p in self.named_parameters()}


def _taps(n: int, side: int, device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear taps (align_corners) of n points over `side` table rows: low, high, weight of
    high."""
    src = torch.arange(n, dtype=torch.float32, device=device) * (side - 1) / max(n - 1, 1)
    low = src.floor()
    return low.long(), (low.long() + 1).clamp(max=side - 1), src - low
