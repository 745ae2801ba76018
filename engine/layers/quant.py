"""int8 linear layers: `Engine(quantization="int8")` (docs/performance.md, "Quantized rollouts").

A weight W [n, k] is kept as it is (the float weights stay the engine's weights: updates write
them, the trainer reads them back) and gets a derived int8 copy, like a packed copy
(linear.py): rebuilt by the ModelRunner inside every weight update's transaction. Both sides of
the product are rotated first by H, the normalised block Hadamard matrix along k (blocks of
hadamard_block(k), at most 512): x W^T = (x H)(W H)^T since H H^T = I. The rotation spreads an
outlier channel over its block, so one large value no longer sets the scale of a whole row; on
SmolLM2-135M it cuts the logprob error of int8 rollouts by more than half (docs/performance.md).

  weight:      Q_w = round(W H / s_w) per output channel,  s_w[i] = max_j |(W H)[i, j]| / 127
  activations: Q_x = round(x H / s_x) per token (dynamic), s_x[t] = max_j |(x H)[t, j]| / 127
  y[t, i] = s_x[t] * s_w[i] * sum_j Q_x[t, j] Q_w[i, j]   (int32 sums, then float32)

The int32 matmul is torch._int_mm (oneDNN: VNNI or AMX kernels), with the weight stored [n, k]
and passed transposed; the CPU kernels (csrc/quant.cpp) quantize x and rescale in one pass each.
Without int8 dot products (INT8_FLAGS) oneDNN's int8 kernels saturate, so the sums are made
exactly another way there (csrc's int8_sums, or int32 matmuls without the kernels).
With AVX512-VNNI the copy is also kept in an int8 blocked layout, and steps of up to 32 rows
(csrc's VNNI_ROWS: batch 1, a rollout's tail) take csrc's VNNI kernel on it, which streams the
weight faster there; its int32 sums are exact too, so the bits do not depend on the path.
Every output row depends on its own inputs only. Where the CPU has neither AVX512-VNNI, AVX-VNNI
nor AMX-INT8 the same math runs (those exact int32 sums) and the reason is logged: correct, not
faster than the float path.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

from hotswap.engine.cpu_features import read_cpu_flags
from hotswap.engine.layers import cpu_kernels

logger = logging.getLogger(__name__)

# CPU flags with int8 dot-product instructions (oneDNN's fast int8 matmuls).
INT8_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")
AVX512_VNNI = "avx512_vnni" in read_cpu_flags()  # csrc's VNNI kernel (vnni_sums)
INT8_DOT = any(f in read_cpu_flags() for f in INT8_FLAGS)
HADAMARD_MAX_BLOCK = 512


class QuantWeight(NamedTuple):
    """The int8 copy of one linear weight [n, k]; on a CPU with AVX512-VNNI also in the int8
    blocked layout (quantize_weight), which a step of few rows multiplies with csrc's VNNI
    kernel: at batch 1 it streams the weight faster than torch._int_mm (docs/performance.md)."""

    weight: torch.Tensor  # int8 [n, k], contiguous: rows of round(W H / scale)
    scale: torch.Tensor  # float32 [n]
    blocked: torch.Tensor | None = None  # int8 [n / 32, k / 4, 32, 4]
    comp: torch.Tensor | None = None  # int32 [n]: 128 * sum_k weight

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self if t is not None)

    def tensors(self) -> list[torch.Tensor]:
        """What csrc's fused decode layers take for it: the scales, then the blocked layout and
        its compensation if any (the int8 weight is passed as the layer's weight)."""
        return [t for t in self[1:] if t is not None]


def hadamard_block(k: int) -> int:
    """The rotation's block for k inputs: the largest power of two dividing k, at most 512 (as
    csrc/ops.h's hadamard_block)."""
    return min(k & -k, HADAMARD_MAX_BLOCK)


@functools.lru_cache(maxsize=8)
def hadamard(block: int) -> torch.Tensor:
    """The normalised (orthogonal, symmetric) Sylvester-Hadamard matrix of order `block`."""
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / block ** 0.5


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Float32 x [m, k] @ H (block diagonal), with torch ops."""
    m, k = x.shape
    block = hadamard_block(k)
    h = hadamard(block).to(x.device)
    return (x.float().reshape(m, k // block, block) @ h).reshape(m, k)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [m, k] rotated, then symmetric int8: (q int8 [m, k], scale float32 [m]) with
    x H ~= q * scale[:, None]. A row of zeros gets scale 0."""
    if cpu_kernels.applies(x):
        return cpu_kernels.quantize_rows(x, hadamard_block(x.shape[1]))
    v = rotate(x)
    amax = v.abs().amax(dim=1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = (v * inv[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0


def can_vnni(weight: torch.Tensor) -> bool:
    """Whether an int8 copy of weight [..., n, k] also takes the blocked layout for csrc's VNNI
    kernel: AVX512-VNNI, the kernels built, n a multiple of 32 and k of 4."""
    n, k = weight.shape[-2:]
    return (AVX512_VNNI and cpu_kernels.applies(weight) and n % cpu_kernels.BLOCK == 0
            and k % 4 == 0)


def quantize_weight(weight: torch.Tensor, out: QuantWeight | None = None,
                    vnni: bool | None = None) -> QuantWeight:
    """The int8 copy of weight [n, k]: per output channel, symmetric, rotated; with `vnni`
    (default: can_vnni) also in the int8 blocked layout (vnni_sums', csrc/quant.cpp), with the
    compensation 128 * sum_k q [n] int32 that turns its u8 x s8 sums of x + 128 back into x's.
    Written into `out` where it is a copy of the same shape and kind (a weight update reuses its
    memory: fresh pages cost more than the quantization itself), else into new tensors."""
    weight = weight.detach()
    if not cpu_kernels.applies(weight):
        q, scale = quantize_rows(weight)
        return QuantWeight(q.contiguous(), scale)
    (n, k), vnni = weight.shape, can_vnni(weight) if vnni is None else vnni
    if out is None or out.weight.shape != (n, k) or (out.blocked is not None) != vnni:
        out = empty_copy(n, k, vnni)
    cpu_kernels.quantize_weight_(weight, hadamard_block(k), *out)
    return out


def empty_copy(n: int, k: int, vnni: bool) -> QuantWeight:
    """Uninitialised tensors for the int8 copy of a weight [n, k] (quantize_weight fills them)."""
    q, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=torch.float32)
    if not vnni:
        return QuantWeight(q, scale)
    blocks = cpu_kernels.BLOCK
    return QuantWeight(q, scale, torch.empty(n // blocks, k // 4, blocks, 4, dtype=torch.int8),
                       torch.empty(n, dtype=torch.int32))


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """The float32 weight the int8 copy stands for (H is its own inverse)."""
    return rotate(qw.weight.float() * qw.scale[:, None])


def int8_linear(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ W.T (+ bias) (+ residual) from the int8 copy of W, in x's dtype (one
    rounding: bias and residual join the float32 rescaling)."""
    k = x.shape[-1]
    if x.dim() != 2:
        lead = x.shape[:-1]
        res = None if residual is None else residual.reshape(-1, residual.shape[-1])
        return int8_linear(x.reshape(-1, k), qw, bias, res).reshape(*lead, -1)
    if cpu_kernels.applies(x):
        return cpu_kernels.int8_linear(x, qw.weight, qw.scale, bias, residual,
                                       hadamard_block(k), qw.blocked, qw.comp)
    q, scale = quantize_rows(x)
    out = int8_sums(q, qw.weight).float() * (scale[:, None] * qw.scale)
    if bias is not None:
        out += bias.float()
    if residual is not None:
        out += residual.float()
    return out.to(x.dtype)


def int8_sums(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """q [m, k] @ weight [n, k].T in int32, exact: torch._int_mm where the CPU has int8 dot
    products; without them oneDNN's int8 kernels saturate int16 pair sums, so int32 matmuls."""
    if INT8_DOT:
        return torch._int_mm(q, weight.t())
    return q.int() @ weight.t().int()


@functools.lru_cache(maxsize=1)
def fast_path() -> tuple[bool, str]:
    """(whether int8 matmuls run fast here, why), logged once."""
    have = [f for f in INT8_FLAGS if f in read_cpu_flags()]
    if not have:
        why = (f"this CPU has none of {', '.join(INT8_FLAGS)}: int8 matmuls run without the "
               "int8 dot-product instructions (correct, not faster than bf16/fp32)")
        logger.warning("quantization='int8': %s", why)
        return False, why
    why = f"int8 matmuls on {', '.join(have)}"
    if not cpu_kernels.available():
        why += "; CPU kernels not built: activations quantized with torch ops (slower)"
    logger.info("quantization='int8': %s", why)
    return True, why
