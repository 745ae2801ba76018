"""SwiGLU's activation: silu(gate) * up over a [T, 2I] (gate | up) projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hotswap.engine.layers import cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]: the CPU kernel where it applies (one pass,
    no [T, I] temporaries), else torch ops."""
    if cpu_kernels.applies(gate_up):
        return cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
