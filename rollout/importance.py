"""Importance-sampling correction for rollouts sampled by another policy than the trainer's.

The engine samples from its own numerics (bf16, int8: `Engine(quantization="int8")`, a stale
version under async rollout) while the trainer's loss assumes its own policy. With trainer
logprobs log pi(y_t) and behaviour (rollout) logprobs log mu(y_t) of the same tokens, the
per-token ratio is

    rho_t = pi(y_t | y_<t) / mu(y_t | y_<t) = exp(log pi_t - log mu_t)

and the policy-gradient loss is weighted per token by w_t (docs/rl.md, "Importance sampling"):

- "token" (truncated IS, as verl and slime correct FP8 rollouts): w_t = min(rho_t, C). Large
  ratios (tokens the rollout policy undersampled) are capped at C, which bounds the variance;
  small ratios are kept.
- "sequence" (sequence-level masked IS): rho = prod_t rho_t over the sequence's trainable
  tokens; w_t = 1 for every token of a sequence with 1/C <= rho <= C, and 0 (the sequence is
  dropped) otherwise.

The weights are constants (no gradient flows through them).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

MODES = ("token", "sequence")


class ImportanceWeights(NamedTuple):
    weights: torch.Tensor  # [rows, tokens] w_t, 0 outside the mask
    ratio: torch.Tensor  # [rows, tokens] rho_t (1 outside the mask)
    truncated: torch.Tensor  # [rows, tokens] bool: trainable tokens capped or dropped

    def truncated_share(self, mask: torch.Tensor) -> float:
        """The share of trainable tokens whose weight was capped or dropped."""
        total = mask.sum().item()
        return (self.truncated & mask.bool()).sum().item() / total if total else 0.0


def importance_weights(trainer_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                       mask: torch.Tensor | None = None, cap: float = 2.0,
                       mode: str = "token") -> ImportanceWeights:
    """Per-token weights from trainer and behaviour logprobs [rows, tokens] (or [tokens]);
    `mask` marks the trainable tokens (default: all), `cap` is C > 1."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not cap > 1:
        raise ValueError(f"cap must be > 1, got {cap}")
    if trainer_logprobs.shape != behavior_logprobs.shape:
        raise ValueError(f"trainer and behavior logprobs differ in shape: "
                         f"{tuple(trainer_logprobs.shape)} vs {tuple(behavior_logprobs.shape)}")
    mask = (torch.ones_like(trainer_logprobs) if mask is None else mask).to(torch.float32)
    log_ratio = (trainer_logprobs.detach().float() - behavior_logprobs.float()) * mask
    ratio = torch.exp(log_ratio)
    if mode == "token":
        weights = ratio.clamp(max=cap) * mask
        truncated = (ratio > cap) & mask.bool()
    else:
        bound = math.log(cap)
        seq = log_ratio.sum(dim=-1, keepdim=True)  # log of the product over trainable tokens
        keep = ((seq >= -bound) & (seq <= bound)).to(torch.float32)
        weights = keep.expand_as(mask) * mask
        truncated = (keep == 0).expand_as(mask) & mask.bool()
    return ImportanceWeights(weights, ratio, truncated)
