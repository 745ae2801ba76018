"""The flat batch one model forward runs over.

Rows are requests; each row contributes `extend_seq_lens[i]` new tokens (1 for a decode row),
laid out contiguously in the flat token tensors, in row order. A row with a non-zero
`extend_prefix_lens[i]` already has that many tokens' KV in the pool (a cached prefix or earlier
chunks/decode steps); its new tokens attend to prefix + themselves, causally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


class ForwardMode(Enum):
    EXTEND = "extend"  # at least one row has more than one new token (prefill, chunk, mixed)
    DECODE = "decode"  # every row has exactly one new token


def flat_ranges(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """starts[i], starts[i] + 1, ..., starts[i] + lens[i] - 1 for every i, concatenated (int64):
    a few ops for the whole batch instead of an arange per row."""
    first = lens.cumsum(0) - lens
    return torch.arange(int(lens.sum())) + torch.repeat_interleave(starts - first, lens)


@dataclass
class VisionInputs:
    """What the vision tower made for a step's image tokens, in flat token rows: their input
    embeddings are replaced by `embeds` (a chunk may hold any part of an image's run)."""

    rows: torch.Tensor  # [n] int64: flat token rows holding image placeholders
    embeds: torch.Tensor  # [n, hidden]: the merged vision features of those tokens
    # [layers, n, hidden] (Qwen3-VL deepstack): added to those rows after each of the first layers
    deepstack: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    # [T] int64; or, in a vision-language model, [3, T] M-RoPE (t, h, w) positions (its
    # prompts' tokens from the first image on differ per stream: layers/rotary.py)
    positions: torch.Tensor
    out_cache_loc: torch.Tensor  # [T] int64: KV slot each new token is written to
    req_pool_indices: torch.Tensor  # [B] int64: rows of the req-to-token table
    seq_lens: torch.Tensor  # [B] int64: prefix + new tokens after this step
    extend_prefix_lens: torch.Tensor  # [B] int64
    extend_seq_lens: torch.Tensor  # [B] int64
    logits_indices: torch.Tensor  # [R] int64: flat token rows whose logits are wanted
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    attn_backend: Any = field(default=None, repr=False)  # set by the ModelRunner
    rope: Any = field(default=None, repr=False)  # (cos, sin) of the positions, set by the model
    attn_metadata: Any = field(default=None, repr=False)  # set by the attention backend
    lora: Any = field(default=None, repr=False)  # LoRABatch when some row uses an adapter
    # [T, moe_layers, top_k]: the MoE layers write each token's experts here when the pool
    # keeps routing (enable_return_routed_experts); set by the ModelRunner
    routes: Any = field(default=None, repr=False)
    # The step's image tokens in a vision-language model (VisionInputs), or None.
    vision: Any = field(default=None, repr=False)
    # Run only the first num_layers decoder layers, then the final norm and head: a self-draft
    # (engine/speculative/self_draft.py). None: every layer.
    num_layers: int | None = None
    # [slots, hidden]: a learned draft's store of the policy's normed last hidden state at each
    # KV slot (engine/speculative/draft.py); the model writes its new tokens' there. Set by the
    # ModelRunner.
    features: Any = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        input_ids: list[int],
        out_cache_loc: torch.Tensor,
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        logits_indices: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Build a batch from per-row lists; positions follow from prefix/extend lengths.

        `logits_indices` defaults to the last new token of every row.
        """
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.EXTEND
        if mode is ForwardMode.DECODE:  # a token a row: at its prefix's length
            positions = torch.tensor(prefix_lens, dtype=torch.int64)
        else:
            positions = flat_ranges(torch.tensor(prefix_lens, dtype=torch.int64),
                                    torch.tensor(extend_lens, dtype=torch.int64))
        if logits_indices is None:
            ends = torch.tensor(extend_lens).cumsum(0) - 1
            logits_indices = ends.tolist()

        def as_tensor(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            mode=mode,
            input_ids=as_tensor(input_ids),
            positions=positions.to(device),
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            req_pool_indices=as_tensor(req_pool_indices),
            seq_lens=as_tensor(seq_lens),
            extend_prefix_lens=as_tensor(prefix_lens),
            extend_seq_lens=as_tensor(extend_lens),
            logits_indices=as_tensor(logits_indices),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=list(extend_lens),
        )
