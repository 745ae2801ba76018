"""Linear layers. On CPU, with the kernels built, a float32 or bf16 weight is multiplied by
cpu_kernels.blocked_linear from a copy in its blocked layout: every output one float32 sum over
k in order, whatever the rows, so a row's bits never depend on its batch-mates. It beat oneDNN's
packed matmul at every row count of SmolLM2's decode shapes, 1 to 64 rows, float32 and bf16,
with AVX-512 and under the AVX2 switch, and streams the weights faster at a few rows than the
matrix-vector kernel did (docs/performance.md#the-blocked-matmul-by-default). With AMX, a bf16
weight takes, up to SMALL_ROWS rows, cpu_kernels.small_linear, a matrix-vector kernel over the
plain weight; up to AMX_ROWS, cpu_kernels.amx_linear, AMX tiles over a copy in their layout,
which streams the weight from memory faster than oneDNN's matmul; above (a long prefill),
oneDNN's matmul over the plain weight. Elsewhere (no kernels, float16, a weight that does not
fit the blocked layout) oneDNN's matmul, faster at the decode shapes than the default BLAS path
with the same float32 accuracy, else F.linear.

A pack (the blocked copy, the AMX copy or oneDNN's reordered one) is a cache of its weight: the
ModelRunner rebuilds packs whenever the weights change and never uses a stale one. With
deterministic=True (batch-invariant, docs/rl.md#deterministic-rollouts-and-exact-logprobs) every
Linear holds the blocked copy, whatever its dtype and the CPU.

With quantization="int8" a Linear also holds an int8 copy of its weight (quant.py), rebuilt by
the ModelRunner like the packs; every step then takes quant.int8_linear, whatever its rows.

On the blocked, small and int8 paths the bias and the residual are added to the float32 sums
before the one rounding; on AMX the bias is, the residual after, and a [gate | up] projection's
SiLU-and-multiply joins the sums too (Linear.silu_and_mul).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.engine.cpu_features import read_cpu_flags
from hotswap.engine.layers import cpu_kernels
from hotswap.engine.layers.activation import silu_and_mul
from hotswap.engine.layers.quant import QuantWeight, int8_linear, quantize_weight

# oneDNN picks the blocked layout for this many rows; any row count works with it.
PACK_ROWS_HINT = 64


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                 "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _onednn_bf16() -> bool:
    """oneDNN runs bf16 matmuls: natively with AVX512-BF16 or AMX, emulated with AVX-512 (or
    AVX-NE-CONVERT); without, bf16 goes through F.linear. torch asks the CPU itself, so the
    flags ask too, for HOTSWAP_CPU_ISA's sake."""
    try:
        torch_says = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
    return torch_says and bool({"avx512bw", "avx_ne_convert"} & read_cpu_flags())


_ONEDNN = _onednn_available()
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if _ONEDNN and _onednn_bf16() else (
    torch.float32,)


def uses_onednn(t: torch.Tensor) -> bool:
    return _ONEDNN and t.device.type == "cpu" and t.dtype in _ONEDNN_DTYPES


def can_pack(weight: torch.Tensor) -> bool:
    return (uses_onednn(weight) and weight.dim() == 2
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where packing does not apply."""
    if not can_pack(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


# How linear() multiplies (cpu_kernels.decode_layers takes the same codes).
ATEN, ONEDNN, SMALL, INT8, BLOCKED, AMX = 0, 1, 2, 3, 4, 5
# bf16 rows that take cpu_kernels.small_linear: where it beat oneDNN (docs/performance.md). With
# AVX512-BF16 the kernel multiplies bf16 pairs as they are and also wins at 5 and 6 rows.
SMALL_ROWS = 6 if "avx512_bf16" in read_cpu_flags() else 4
# With AMX, bf16 weights take AMX tiles instead of the blocked kernel.
AMX_BF16 = "amx_bf16" in read_cpu_flags()
# Rows up to which amx_linear multiplies an AMX copy; above, oneDNN the plain weight, as fast
# or faster there (amx_linear passes over all the rows for every 32 outputs).
AMX_ROWS = 512


def can_block(weight: torch.Tensor, pad: bool = False) -> bool:
    """Whether a weight [n, k] fits cpu_kernels' blocked layout: a float32 or bf16 CPU tensor
    with, in bf16, k even and n a multiple of 32, unless `pad` (an lm_head, whose outputs join
    no residual: block_pack pads it to whole blocks)."""
    return (weight.dim() == 2 and cpu_kernels.applies(weight)
            and (pad or weight.shape[0] % cpu_kernels.BLOCK == 0)
            and weight.shape[1] % (4 // weight.element_size()) == 0)


def blocks_by_default(weight: torch.Tensor, pad: bool = False) -> bool:
    """Whether the default mode multiplies this weight blocked: where it fits (can_block),
    except bf16 on an AMX CPU, whose oneDNN matmul runs on the AMX tiles (not measured against
    here)."""
    return can_block(weight, pad) and not (weight.dtype == torch.bfloat16 and AMX_BF16)


def amx_packs(weight: torch.Tensor) -> bool:
    """Whether a Linear's packed copy of this weight is cpu_kernels.amx_pack's: a bf16 weight
    [n, k], n a multiple of 32, on a CPU whose AMX the kernels use."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and AMX_BF16
            and weight.shape[0] % 32 == 0 and cpu_kernels.applies(weight) and cpu_kernels.amx())


def pack_linear(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy a Linear keeps of its weight: the AMX copy where amx_packs, else
    oneDNN's (pack), or None."""
    return cpu_kernels.amx_pack(weight.detach()) if amx_packs(weight) else pack(weight)


def is_amx_pack(packed: torch.Tensor | None) -> bool:
    """An AMX copy is a plain tensor; oneDNN's packs are oneDNN tensors."""
    return packed is not None and packed.layout == torch.strided


def matmul_path(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, quant: QuantWeight | None = None,
                blocked: torch.Tensor | None = None, packed: torch.Tensor | None = None) -> int:
    """BLOCKED where the weight has a blocked copy (by default, or deterministic=True); INT8
    where it has an int8 copy; SMALL for a bf16 x of at most SMALL_ROWS rows, a plain bf16
    weight (bias, residual bf16 too) on CPU with the kernels built; AMX for a bf16 x of at most
    AMX_ROWS rows where the weight has an AMX copy; else ONEDNN where oneDNN runs x's dtype
    (over the weight's oneDNN copy, or the plain weight), else ATEN."""
    if blocked is not None:
        return BLOCKED
    if quant is not None:
        return INT8
    if (x.dim() == 2 and len(x) <= SMALL_ROWS and x.dtype == weight.dtype == torch.bfloat16
            and weight.layout == torch.strided and weight.is_contiguous()
            and all(t is None or t.dtype == x.dtype for t in (bias, residual))
            and cpu_kernels.applies(x)):
        return SMALL
    if (is_amx_pack(packed) and x.dim() == 2 and len(x) <= AMX_ROWS
            and x.dtype == torch.bfloat16 and (bias is None or bias.dtype == x.dtype)):
        return AMX
    return ONEDNN if uses_onednn(x) and x.dim() == 2 else ATEN


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, residual: torch.Tensor | None = None,
           quant: QuantWeight | None = None, blocked: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x @ weight.T + bias (+ residual); `packed` / `quant` / `blocked`, when given, must be
    pack_linear(weight) / quant.quantize_weight(weight) / cpu_kernels.block_pack(weight) of the
    current weight. On BLOCKED, SMALL and INT8 the residual joins
    the kernel's float32 sums (one rounding in bf16); elsewhere it is added to the matmul's
    output (in bf16 rounded twice, as HF's bf16 does): oneDNN's add post-op costs more than
    the separate add, at any size (docs/performance.md)."""
    # Above SMALL_ROWS (and at every row count on BLOCKED), every row count takes the same
    # path, so a row's result does not depend on how many rows share its step. (SiLU/product
    # as oneDNN post-ops at 64 rows were faster, but give results that differ in the last bits
    # with the row count.)
    path = matmul_path(x, weight, bias, residual, quant, blocked, packed)
    if path == BLOCKED:
        return cpu_kernels.blocked_linear(x, blocked, bias, residual)
    if path == INT8:
        return int8_linear(x, quant, bias, residual)
    if path == SMALL:
        return cpu_kernels.small_linear(x, weight, bias, residual)
    if path == AMX:
        out = cpu_kernels.amx_linear(x, packed, bias)
    elif path == ONEDNN:
        w = weight if packed is None or is_amx_pack(packed) else packed
        out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, "none", [], "")
    else:
        out = F.linear(x, weight, bias)
    return out if residual is None else out.add_(residual)


class Linear(nn.Linear):
    packed: torch.Tensor | None = None  # pack_linear(self.weight), kept current by the ModelRunner
    quant: QuantWeight | None = None  # its int8 copy (quantization="int8"), kept current too
    blocked: torch.Tensor | None = None  # its blocked copy (deterministic=True), kept current too

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, residual, self.quant, self.blocked)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate | up] projection of x: on AMX in the matmul's epilogue
        (from the float32 sums, rounded once; models/llama.py's fused layers do the same), else
        the matmul, then activation.silu_and_mul."""
        if self.gated_amx() and matmul_path(x, self.weight, None, None, self.quant, self.blocked,
                                            self.packed) == AMX:
            return cpu_kernels.amx_linear(x, self.packed, gated=True)
        return silu_and_mul(self(x))

    def gated_amx(self) -> bool:
        """Whether amx_linear can multiply this [gate | up] projection gated: an AMX copy, each
        half whole blocks of 32 outputs, no bias."""
        return is_amx_pack(self.packed) and self.bias is None and len(self.packed) % 2 == 0

    def fused_weights(self, path: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(what cpu_kernels.decode_layers multiplies on `path`, the rest of the int8 copy)."""
        if path == INT8:
            return self.quant.weight, self.quant.tensors()
        if path == BLOCKED:
            return self.blocked, []
        own = self.packed is not None and path != SMALL and (path == AMX) == is_amx_pack(
            self.packed)
        return (self.packed if own else self.weight), []


def quantized_linears(model: nn.Module) -> Iterable[nn.Module]:
    """Every layers/linear.py Linear of the model but its lm_head. MoE routers are torch Linears
    and stay in the model's dtype; the experts have their own int8 copies (layers/moe.py)."""
    head = getattr(model, "lm_head", None)
    return (m for m in model.modules() if isinstance(m, Linear) and m is not head)


def quantize_model(model: nn.Module, enable: bool, head: bool = False) -> int:
    """Rebuild (or drop) the int8 copy of every linear weight (and of the lm_head with `head`),
    into the old copy's memory where there is one; the model's pack_weights, which runs after
    it, packs nothing that has one. Returns the bytes the int8 copies hold."""
    total = 0
    for module in quantized_linears(model):
        module.quant = quantize_weight(module.weight, module.quant) if enable else None
        if enable:
            total += module.quant.nbytes
    quant_head = (quantize_weight(model.lm_head_weight, model.lm_head_quant)
                  if enable and head else None)
    model.lm_head_quant = quant_head
    if quant_head is not None:
        total += quant_head.nbytes
    return total
