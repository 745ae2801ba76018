"""Linear layers. On CPU in float32 (and in bfloat16 where the CPU has AVX512-BF16 or AMX) they
run oneDNN's matmul instead of the default BLAS path:
measured here (AVX-512 EPYC, 2 threads) the SmolLM2 projections at batch 64 take 43 ms instead
of 82 ms for all 30 layers, and the 49k-row lm_head 10.7 ms instead of 26 ms, with fp32
results (max error 5e-6 on unit-scale outputs, as BLAS). Elsewhere: F.linear.
In bf16 a packed weight matters more: the 64-row projections take 1.4-1.6x less time packed
than through F.linear, the lm_head 2.2x less (one thread, this machine).

A weight can also be packed: a copy reordered once into oneDNN's blocked layout, which the
matmul then reads without converting it on every call (37 ms instead of 43 ms for the 30
layers above, 8.2 ms instead of 10 ms for the lm_head). A pack is a cache of its weight; the
ModelRunner rebuilds packs whenever the weights change and never uses a stale one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks the blocked layout for this many rows; any row count works with it.
PACK_ROWS_HINT = 64
# float32 inputs of at most this many rows (batch-1 decode) go to F.linear: MKL's matrix-vector
# kernel streams the weight faster than oneDNN does (measured, 30 layers' gate_up and down of
# SmolLM2, weights not in cache: 1 row 12.3 ms against 15.1 ms packed, 2 rows 13.4 against 15.4;
# from 4 rows on oneDNN wins, 15.7 against 20.0). bf16 packed wins at every row count.
FP32_GEMV_ROWS = 2


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                 "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _onednn_bf16_fast() -> bool:
    """oneDNN runs bf16 natively (AVX512-BF16 or AMX); without it, bf16 goes through F.linear."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_available()
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if _ONEDNN and _onednn_bf16_fast() else (
    torch.float32,)


def _uses_onednn(t: torch.Tensor) -> bool:
    return _ONEDNN and t.device.type == "cpu" and t.dtype in _ONEDNN_DTYPES


def onednn_path(x: torch.Tensor) -> bool:
    """Whether `linear` runs x through oneDNN (else F.linear, which ignores packed copies)."""
    if not (_uses_onednn(x) and x.dim() == 2):
        return False
    return x.dtype != torch.float32 or x.shape[0] > FP32_GEMV_ROWS


def can_pack(weight: torch.Tensor) -> bool:
    return (_uses_onednn(weight) and weight.dim() == 2
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where packing does not apply."""
    if not can_pack(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, residual: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x @ weight.T + bias (+ residual); `packed`, when given, must be pack(weight) of the
    current weight. On oneDNN the residual add is a post-op of the matmul (no extra pass over
    the output, and in bf16 one rounding instead of two)."""
    if onednn_path(x) or weight.is_mkldnn:  # (a weight kept only packed: the fp32 lm_head)
        w = weight if packed is None else packed
        if residual is not None and residual.dtype == x.dtype:
            return torch.ops.mkldnn._linear_pointwise.binary(
                x.contiguous(), residual.contiguous(), w, bias, "add")
        out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, "none", [], "")
    else:
        out = F.linear(x, weight, bias)
    return out if residual is None else out.add_(residual)


def silu_mul(x: torch.Tensor, gate_packed: torch.Tensor, up_packed: torch.Tensor
             ) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) from the packed gate and up weights (see `pack`), for x on
    the oneDNN path: SiLU is a post-op of the first matmul and the product one of the second, so
    the [T, 2I] gate_up output, its split and two elementwise passes never exist."""
    x = x.contiguous()
    gate = torch.ops.mkldnn._linear_pointwise(x, gate_packed, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, gate, up_packed, None, "mul")


class Linear(nn.Linear):
    packed: torch.Tensor | None = None  # pack(self.weight), kept current by the ModelRunner

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, residual)
