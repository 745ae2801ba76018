"""Fused CPU kernels (csrc/, one source per op family), float32 and bfloat16: paged decode
attention (attention.cpp), in-place rotary (rope.cpp), RMSNorm (norm.cpp), SiLU-and-multiply
(activation.cpp), a small-batch matmul over bf16 weights (small_linear.cpp), the blocked
matmul whose sums never depend on the batch (blocked_linear.cpp), the float32 lm_head
of a bf16 model as AMX matmuls of an exact split (head.cpp), bf16 matmuls on AMX tiles
(amx_linear.cpp), int8 matmuls (quant.cpp), sampling (sampling.cpp), a mixture-of-experts
layer's experts (moe.cpp), and every
decoder layer of a decode-only step in one call (decode_layer.cpp); bindings.cpp registers them
as torch.ops.hotswap.*.

Without them a decode layer is ~25 torch ops whose dispatch and extra passes cost more than its
matmuls at batch 1, and decode attention gathers every row's keys into a padded copy first. The
kernels are compiled once (kernel_build.py: a C++ compiler and ninja, about a minute; `make
setup` does it ahead, `python -m hotswap.engine.layers.cpu_kernels`) into torch's extension
cache, under a name keyed by the sources' bytes, the compiler flags, torch's version and, for
-march=native, the CPU: two checkouts of one version share a build, and no checkout or ISA
evicts another's. Setup removes the builds no current source uses (remove_old_builds).
HOTSWAP_CPU_ISA=avx2 or avx512 (cpu_features.cpu_isa) builds them for that ISA instead of the CPU's.
Where they cannot be built, or with HOTSWAP_CPU_KERNELS=0, the torch-ops path runs instead (the
same math, more ops) and the reason is logged once.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from hotswap.engine.cpu_features import cpu_isa, read_cpu_flags
from hotswap.engine.layers import kernel_build

DTYPES = (torch.float32, torch.bfloat16)
_loaded: bool | None = None  # None: not tried yet


def available() -> bool:
    """Whether the kernels are loaded (built on the first call)."""
    global _loaded
    if _loaded is None:
        _loaded = kernel_build.build()
    return _loaded


def applies(t: torch.Tensor) -> bool:
    """Whether the kernels take this tensor: on the CPU, float32 or bfloat16, once built."""
    return t.device.type == "cpu" and t.dtype in DTYPES and available()


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     req_to_token: torch.Tensor, req_idx: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [n, Hq * D] (one new token per row) over each row's seq_lens[i] keys at
    req_to_token[req_idx[i], :seq_lens[i]] of the pool k_buf / v_buf [slots, Hkv, D]."""
    return torch.ops.hotswap.decode_attention(q, k_buf, v_buf, req_to_token, req_idx, seq_lens,
                                              scale)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place (half-rotation layout) by float32 cos, sin [T, D/2]."""
    return torch.ops.hotswap.rotary_(x, cos, sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dim of x [T, H] with weight [H] of x's dtype, in one call."""
    return torch.ops.hotswap.rms_norm(x, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    return torch.ops.hotswap.silu_and_mul(x)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                packed13: list[torch.Tensor], packed2: list[torch.Tensor], topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, small_rows: int, dense_path: int,
                blocked13: torch.Tensor | None, blocked2: torch.Tensor | None,
                quant: list[torch.Tensor]) -> torch.Tensor:
    """layers/moe.py's grouped_experts in one call, the experts spread over the threads;
    dense_path linear.py's ONEDNN or ATEN (then no packed weights), what linear() takes for an
    expert's rows beyond small_rows; `quant` the experts' int8 copies (layers/moe.py's
    ExpertQuant.tensors()) or empty."""
    return torch.ops.hotswap.moe_experts(x, w13, w2, packed13, packed2, topk_ids, topk_weights,
                                         small_rows, dense_path, blocked13, blocked2, quant)


BLOCK = 32  # outputs per block of the blocked layout


# Transparent huge pages: a 2 MiB page the kernel maps where a region asks for it (madvise, the
# default setting of most distributions; "always" needs no asking, "never" ignores it).
HUGE_PAGE = 2 << 20


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised CPU tensor in memory that asks the kernel for 2 MiB pages (from its
    first 2 MiB boundary), so that a stream over it crosses a page boundary, and misses the
    TLB, 512 times less often: a layer-by-layer one-row pass over SmolLM2's blocked weights ran
    8-15% faster (docs/performance.md). The tensor is its storage's whole, as a flat buffer of
    parameters must be (weights/standby.py). Below one huge page, where the OS has no such
    advice, or on another device, torch.empty. Untouched pages stay unmapped, as torch.empty's."""
    nbytes = math.prod(shape) * dtype.itemsize
    if (torch.device(device).type != "cpu" or nbytes < HUGE_PAGE
            or not hasattr(mmap, "MADV_HUGEPAGE")):
        return torch.empty(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    start = -torch.frombuffer(region, dtype=torch.uint8).data_ptr() % HUGE_PAGE
    # The slice's buffer keeps the mapping until the tensor is freed.
    raw = torch.frombuffer(memoryview(region)[start: start + nbytes], dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def side_by_side(weights: list[torch.Tensor], shapes: list[tuple[int, ...]], packer: Callable,
                 regions: dict, key: object) -> list[torch.Tensor]:
    """packer(w, out=...) of each weight (all of one dtype), the copies side by side in that
    order in one huge_empty region (a decode step streams them as one stretch of huge pages).
    `regions[key]` keeps the region for the next call, which writes the same sizes into it
    again: a fresh region's first touch costs more than the packing itself (0.5-0.75 s for
    SmolLM2's layers, against 0.15-0.2 s in 4 KiB pages), so a model packs each weight update
    into the memory of the last one."""
    if not weights:
        return []
    total = sum(math.prod(shape) for shape in shapes)
    if key not in regions or regions[key].numel() != total:
        regions[key] = huge_empty((total,), weights[0].dtype)
    out, start = [], 0
    for w, shape in zip(weights, shapes):
        out.append(packer(w, out=regions[key][start: start + math.prod(shape)].view(shape)))
        start += math.prod(shape)
    return out


def block_pack_all(weights: list[torch.Tensor],
                   regions: dict | None = None) -> list[torch.Tensor]:
    """block_pack of each CPU weight, the copies of one dtype side by side (side_by_side, the
    region under the dtype's key)."""
    regions = {} if regions is None else regions
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, w in enumerate(weights):
        by_dtype.setdefault(w.dtype, []).append(i)
    out: list[torch.Tensor] = [None] * len(weights)
    for dtype, mine in by_dtype.items():
        packs = side_by_side([weights[i] for i in mine], [_blocked_shape(weights[i]) for i in mine],
                             block_pack, regions, dtype)
        for i, packed in zip(mine, packs):
            out[i] = packed
    return out


def _blocked_shape(w: torch.Tensor) -> tuple[int, ...]:
    *lead, n, k = w.shape
    group = 4 // w.element_size()
    return (*lead, -(-n // BLOCK), k // group, BLOCK, group)


def block_pack(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Weights [..., n, k] in the blocked layout [..., n / 32, k / G, 32, G] the csrc kernels
    read, G the inputs one 32-bit lane holds (2 in bf16, 1 in float32, 4 in int8: the layout
    quantize_weight_ writes for the VNNI kernel): for each block of 32 outputs and each group of
    G inputs, the 32 outputs' weights side by side. A kernel loads a block's weights for a group
    in two vectors and broadcasts x's group (AVX512-BF16's pairwise products, float32 FMAs or
    VNNI's int8 ones), with no horizontal sums; n not a multiple of 32 is padded with zero
    outputs (blocked_linear then returns them too). For the experts blocked_linear beat both the
    small-batch kernel and oneDNN's packed matmul at every row count of bench/moe.py's shapes
    (docs/performance.md). With `out` (that layout's shape and w's dtype), written there."""
    *lead, n, k = w.shape
    group = 4 // w.element_size()
    if n % BLOCK:  # outputs padded with zero rows to whole blocks (a router of 8 experts)
        w = torch.nn.functional.pad(w.detach(), (0, 0, 0, BLOCK - n % BLOCK))
        n = w.shape[-2]
    blocks = (w.detach().reshape(-1, n // BLOCK, BLOCK, k // group, group)
              .permute(0, 1, 3, 2, 4))
    if out is None:
        return blocks.contiguous().view(_blocked_shape(w))
    out.view(blocks.shape).copy_(blocks)
    return out


def widen_blocked(blocked: torch.Tensor) -> torch.Tensor:
    """The float32 blocked layout of a weight from its bf16 one (block_pack of weight.float()
    from block_pack of the bf16 weight), in one pass over the bf16 copy."""
    *lead, blocks, pairs, _, _ = blocked.shape
    out = torch.empty(*lead, blocks, pairs * 2, BLOCK, 1)
    out.view(*lead, blocks, pairs, 2, BLOCK).copy_(blocked.transpose(-1, -2))
    return out


def blocked_linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None, float_out: bool = False,
                   outputs: int = -1) -> torch.Tensor:
    """x [m, k] @ weight.T (+ bias) (+ residual), the weight [n, k] given in the blocked layout
    (block_pack; `outputs` = n where block_pack padded it, else -1), in x's dtype (float32
    with float_out): every output one float32 sum over k in
    order, whatever the rows, their order or the thread count (the batch-invariant linear); the
    vector kernel with AVX-512 (AVX512-BF16 for bf16), a portable one elsewhere."""
    return torch.ops.hotswap.blocked_linear(x, blocked, bias, residual, float_out, outputs)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ weight.T (+ bias) (+ residual) for a few rows m: weight [n, k] bfloat16 as it
    lies, x float32 or bfloat16, the result in x's dtype (float32 sums, rounded once)."""
    return torch.ops.hotswap.small_linear(x, weight, bias, residual)


def quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [m, k] rotated by the block Hadamard transform, then int8 [m, k] symmetric per
    row, and the float32 scales [m] (layers/quant.py)."""
    return torch.ops.hotswap.quantize_rows(x, block)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, residual: torch.Tensor | None, block: int,
                blocked: torch.Tensor | None = None, comp: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [m, k] (float32 or bf16) @ the int8 weight [n, k] with its float32 scales [n], x
    quantized per row as quantize_rows does; (+ bias) (+ residual), in x's dtype. blocked, comp:
    the weight in the int8 blocked layout and its compensation (quantize_weight_'s),
    which few rows multiply with the VNNI kernel; the int32 sums are exact either way."""
    return torch.ops.hotswap.int8_linear(x, weight, scale, bias, residual, block, blocked, comp)


def quantize_weight_(weight: torch.Tensor, block: int, q: torch.Tensor, scale: torch.Tensor,
                     blocked: torch.Tensor | None, comp: torch.Tensor | None) -> None:
    """weight [n, k] quantized as quantize_rows does, into q int8 [n, k] and scale float32 [n];
    with blocked, comp also into the int8 blocked layout [n / 32, k / 4, 32, 4] (block_pack's)
    and the compensation 128 * sum_k q [n] int32 that the VNNI kernel reads (one pass)."""
    torch.ops.hotswap.quantize_weight_(weight, block, q, scale, blocked, comp)


def sample_rows(x: torch.Tensor, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [n] int64 drawn from softmax(x) [n, V] float32 at uniforms u [n] float64 by
    sampling.py's two-level inverse CDF (u None: the first argmax), and each row's
    log-sum-exp [n] float64."""
    return torch.ops.hotswap.sample_rows(x, u)


def amx() -> bool:
    """Whether bf16 matmuls, the float32 head's included, can run on AMX tiles (amx_pack /
    amx_linear, head_pack / head_logits): AMX on the CPU (and not switched off by
    HOTSWAP_CPU_ISA), and a compiler that built the kernels."""
    return available() and "amx_bf16" in read_cpu_flags() and torch.ops.hotswap.head_amx()


def amx_pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bf16 weight [n, k] (n a multiple of 32) in the tiles' layout amx_linear reads; with
    `out` (amx_shape(weight), bf16), written there."""
    return torch.ops.hotswap.amx_pack(weight, out)


def amx_shape(weight: torch.Tensor) -> tuple[int, int]:
    """The shape of amx_pack(weight) (head_pack's: the rows padded to whole blocks of 32)."""
    n, k = weight.shape
    return -(-n // 32), -(-k // 32) * 32 * 32


def amx_pack_all(weights: list[torch.Tensor], regions: dict | None = None) -> list[torch.Tensor]:
    """amx_pack of each bf16 weight, side by side in one huge_empty region (side_by_side, under
    the key "amx"): an 8- to 64-row pass over SmolLM2's layers ran 9-14% faster than over
    copies in 4 KiB pages (docs/performance.md)."""
    return side_by_side(weights, [amx_shape(w) for w in weights], amx_pack,
                        {} if regions is None else regions, "amx")


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
               gated: bool = False) -> torch.Tensor:
    """bf16 x [m, k] @ W.T (+ bias) for packed = amx_pack(W): float32 sums over k, rounded once
    to bf16 (csrc/amx_linear.cpp). gated, for W = [gate | up] (each half a multiple of 32 rows;
    no bias): silu(x @ gate.T) * (x @ up.T) [m, n / 2] from the float32 sums, rounded once."""
    return torch.ops.hotswap.amx_linear(x, packed, bias, gated)


def head_pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 lm_head weight [vocab, k] in amx_pack's layout (its rows padded to whole blocks
    of 32), as head_logits reads it."""
    return torch.ops.hotswap.head_pack(weight, out)


def head_logits(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """Float32 logits [m, vocab] of bf16 hidden states [m, k]: the final RMSNorm and the lm_head
    with float32 products and sums, from two exact bf16 parts of the normed state
    (csrc/head.cpp)."""
    return torch.ops.hotswap.head_logits(hidden, norm_weight, eps, packed, vocab)


class LayerWeights(NamedTuple):
    """One decoder layer's weights as linear.py's linear() multiplies them on the path of the
    DecodeLayers that holds them (the packed copy where there is one, except on SMALL; on INT8
    the int8 weights, each with the rest of its int8 copy: layers/quant.py's
    QuantWeight.tensors(), empty on other paths)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_quant: list[torch.Tensor] = []
    o_quant: list[torch.Tensor] = []
    gate_up_quant: list[torch.Tensor] = []
    down_quant: list[torch.Tensor] = []


def decode_stack(layers: Iterable[LayerWeights], eps: float, path: int, num_heads: int
                 ) -> torch.ScriptObject:
    """A model's decoder layers for decode_layers (a torch.classes.hotswap.DecodeLayers): built
    once per set of weights, it holds references to them, so whoever replaces a weight tensor
    or its packed copy builds a new one. `path` is linear.py's ATEN, ONEDNN, SMALL or INT8."""
    stack = torch.classes.hotswap.DecodeLayers(eps, path, num_heads)
    for layer in layers:
        stack.add_layer(*layer)
    return stack


def decode_layers(x: torch.Tensor, stack: torch.ScriptObject, k_bufs: list[torch.Tensor],
                  v_bufs: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  loc: torch.Tensor, req_to_token: torch.Tensor, req_idx: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Every decoder layer of `stack` over a decode-only batch x [n, hidden] in one call: each
    layer writes its K/V at slots loc [n] of k_bufs[i] / v_bufs[i] and attends as
    decode_attention does; cos, sin are the step's rotary tables as rotary_ takes them. The
    profiler sees the call as hotswap::decode_layers, each layer as hotswap::decode_layer."""
    return stack.forward(x, k_bufs, v_bufs, cos, sin, loc, req_to_token, req_idx, seq_lens, scale)


def main() -> None:
    """Build the kernels now (`make setup`), so that an Engine's first start does not, and
    remove the builds of older sources, ISAs' flags and torch versions."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    if not available():
        print("hotswap: CPU kernels not built (see above): the engine runs torch ops instead")
        return
    build = kernel_build.build_spec()
    print(f"hotswap: CPU kernels for {cpu_isa()} ready in {build.directory} "
          f"({time.perf_counter() - start:.1f} s)")
    removed = kernel_build.remove_old_builds(build.directory.parent)
    if removed:
        print(f"hotswap: removed {len(removed)} old kernel builds from {build.directory.parent}")


if __name__ == "__main__":
    main()
