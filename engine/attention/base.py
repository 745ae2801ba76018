"""The attention backend interface: one object per ModelRunner, metadata built once per step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.kvcache.memory import KVPool


class FusedDecodeInputs(NamedTuple):
    """The attention inputs of a step whose every token is a kernel query (decode rows, short
    extend rows) for layers/cpu_kernels.decode_layers."""

    k_buffers: list[torch.Tensor]  # per layer [slots, Hkv, D]
    v_buffers: list[torch.Tensor]
    out_cache_loc: torch.Tensor  # [n] slot of each query token
    req_to_token: torch.Tensor
    req_idx: torch.Tensor  # [n] int64
    seq_lens: torch.Tensor  # [n] int64 keys each query sees, its own token included
    scale: float


class AttentionBackend(ABC):
    """Writes the step's new K/V into the pool and attends over each row's slots.

    `forward` takes q [T, num_heads * head_dim] and k, v [T, num_kv_heads * head_dim] for the new
    tokens of the batch and returns [T, num_heads * head_dim]. Row i's new tokens attend causally
    to the row's `seq_lens[i]` tokens, whose slots are
    `req_to_token[req_pool_indices[i], :seq_len]`.
    """

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, scaling: float):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        # deterministic=True on the CPU kernels (the ModelRunner sets it): every query, of a
        # prefill, a chunk or a decode step, attends by the same per-query kernel.
        self.batch_invariant = False

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build the step's index tensors once; every layer reuses them."""

    def fused_decode_inputs(self, fb: ForwardBatch) -> FusedDecodeInputs | None:
        """What the fused CPU decoder layer needs to attend in this step, or None where it does
        not apply (only the torch backend on CPU, for a decode-only step, provides it)."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        """Store k/v at `fb.out_cache_loc` for `layer_id`, then attend."""
