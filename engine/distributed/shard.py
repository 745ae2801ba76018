"""Tensor-parallel sharding of the Llama family: which slice of each HF tensor a rank holds.

Rank r of N holds attention heads [r*H/N, (r+1)*H/N) with their KV heads (split when N divides
the KV heads, replicated when N is a multiple of them), MLP columns [r*I/N, (r+1)*I/N) of
gate/up and the matching rows of down's input, and o_proj's input columns of its heads
(row-parallel: partial sums, all-reduced). Embedding and lm_head are vocab-parallel: rank r holds
rows [r*V'/N, (r+1)*V'/N) of the vocabulary padded to V', the next multiple of N (padding rows are
zeros and their logits are dropped). Norms are replicated. A rank's model is then the ordinary
model built from `shard_config` (fewer heads, a narrower MLP, V'/N vocabulary rows).

MoE layers split every expert the way the dense MLP is split: rank r holds columns
[r*I/N, (r+1)*I/N) of each expert's gate and up and the matching inputs of its down, in either
checkpoint naming (per expert, or transformers 5's stacked [E, 2I, H] / [E, H, I]); the router
is replicated. Expert parallelism (whole experts per rank) is not implemented.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from hotswap.engine.config import ModelConfig

VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
# An expert's tensor in either naming (models/moe.py) -> what it holds.
_EXPERT = re.compile(r"\.experts\.(?:\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
                     r"|(gate_up_proj|down_proj))$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}


def vocab_rows(vocab_size: int, tp_size: int) -> int:
    """Vocabulary rows per rank: the vocabulary padded up to a multiple of tp_size, split."""
    return -(-vocab_size // tp_size)


def check_tp(cfg: ModelConfig, tp_size: int) -> None:
    """ValueError naming the numbers when the model does not split over tp_size ranks."""
    if cfg.num_heads % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide the {cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"tp_size {tp_size} neither divides the {kv} KV heads nor is a "
                         "multiple of them")
    if cfg.has_dense_layers and cfg.intermediate_size % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide the MLP intermediate size "
                         f"{cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide the experts' intermediate size "
                         f"{cfg.moe_intermediate_size}")


def shard_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """What one rank's model looks like (the same for every rank)."""
    check_tp(cfg, tp_size)
    return replace(cfg, num_heads=cfg.num_heads // tp_size,
                   num_kv_heads=max(1, cfg.num_kv_heads // tp_size),
                   intermediate_size=cfg.intermediate_size // tp_size,
                   moe_intermediate_size=cfg.moe_intermediate_size // tp_size,
                   vocab_size=vocab_rows(cfg.vocab_size, tp_size))


def shard_tensor(name: str, full: torch.Tensor, cfg: ModelConfig, tp_rank: int,
                 tp_size: int) -> torch.Tensor:
    """Rank tp_rank's part of the full HF tensor `name` (a view where possible)."""
    hd = cfg.head_dim
    if name in VOCAB_PARALLEL:
        return _vocab_slice(full, tp_rank, vocab_rows(cfg.vocab_size, tp_size))
    expert = _EXPERT.search(name)
    if expert is not None:
        return _expert_shard(expert, full, cfg, tp_rank, tp_size)
    part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    if part == "q_proj":
        return _rows(full, tp_rank * cfg.num_heads // tp_size * hd, cfg.num_heads // tp_size * hd)
    if part in ("k_proj", "v_proj"):
        heads = max(1, cfg.num_kv_heads // tp_size)
        return _rows(full, kv_head_of(cfg, tp_rank, tp_size) * hd, heads * hd)
    if part == "o_proj":
        width = cfg.num_heads // tp_size * hd
        return full[:, tp_rank * width:(tp_rank + 1) * width]
    if part in ("gate_proj", "up_proj"):
        size = cfg.intermediate_size // tp_size
        return _rows(full, tp_rank * size, size)
    if part == "down_proj":
        size = cfg.intermediate_size // tp_size
        return full[:, tp_rank * size:(tp_rank + 1) * size]
    return full


def kv_head_of(cfg: ModelConfig, tp_rank: int, tp_size: int) -> int:
    """The first KV head rank tp_rank holds (its query heads' group when KV is replicated)."""
    kv = cfg.num_kv_heads
    if kv >= tp_size:
        return tp_rank * (kv // tp_size)
    return tp_rank // (tp_size // kv)


def unshard(name: str, shards: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The full tensor from every rank's shard (rank order); inverse of shard_tensor."""
    tp_size = len(shards)
    if name in VOCAB_PARALLEL:
        return torch.cat(shards, dim=0)[:cfg.vocab_size]  # drops the padding rows
    expert = _EXPERT.search(name)
    if expert is not None:
        return _expert_unshard(expert, shards)
    part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    if part in ("o_proj", "down_proj"):
        return torch.cat(shards, dim=1)
    if part in ("q_proj", "gate_proj", "up_proj"):
        return torch.cat(shards, dim=0)
    if part in ("k_proj", "v_proj"):
        if cfg.num_kv_heads >= tp_size:
            return torch.cat(shards, dim=0)
        step = tp_size // cfg.num_kv_heads  # replicas: one per group of ranks
        return torch.cat(shards[::step], dim=0)
    return shards[0]


def _expert_shard(expert: re.Match, full: torch.Tensor, cfg: ModelConfig, tp_rank: int,
                  tp_size: int) -> torch.Tensor:
    size = cfg.moe_intermediate_size // tp_size
    cols = slice(tp_rank * size, (tp_rank + 1) * size)
    if expert.group(2) == "gate_up_proj":  # [E, 2I, H]: this rank's gate rows, then its up rows
        up = slice(cfg.moe_intermediate_size + cols.start, cfg.moe_intermediate_size + cols.stop)
        return torch.cat((full[:, cols], full[:, up]), dim=1)
    if expert.group(2) == "down_proj":  # [E, H, I]
        return full[:, :, cols]
    return full[:, cols] if _EXPERT_PART[expert.group(1)] == "down" else full[cols]


def _expert_unshard(expert: re.Match, shards: list[torch.Tensor]) -> torch.Tensor:
    if expert.group(2) == "gate_up_proj":
        halves = [s.chunk(2, dim=1) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)
    if expert.group(2) == "down_proj":
        return torch.cat(shards, dim=2)
    return torch.cat(shards, dim=1 if _EXPERT_PART[expert.group(1)] == "down" else 0)


def _rows(full: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return full[start:start + size]


def _vocab_slice(full: torch.Tensor, tp_rank: int, rows: int) -> torch.Tensor:
    """Rows [tp_rank*rows, (tp_rank+1)*rows), zero-padded past the end of the vocabulary."""
    part = full[tp_rank * rows:(tp_rank + 1) * rows]
    if part.shape[0] == rows:
        return part
    padded = full.new_zeros((rows, *full.shape[1:]))
    padded[:part.shape[0]] = part
    return padded
