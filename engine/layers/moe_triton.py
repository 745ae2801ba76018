"""The experts of an MoE layer as two grouped GEMMs on CUDA (Triton): tokens sorted by expert.

The (token, slot) pairs are sorted by expert id and each expert's run is padded to a multiple of
BLOCK_M (`align`, torch ops, no host sync), so every BLOCK_M-row tile of the sorted order belongs
to one expert: a program multiplies one tile by one BLOCK_N-column block of that expert's weight.
The first GEMM gives gate|up per slot [T*k, 2I], SiLU-and-multiply makes [T*k, I], the second
GEMM gives each slot's down-projection scaled by its routing weight, and the k slots of a token
are summed. Accumulation is float32; float32 dots run in IEEE precision (no TF32).

Triton's interpreter (TRITON_INTERPRET=1, the CPU test path) stores bfloat16 as raw bits, so
under it every loaded operand is upcast to float32 first (`UPCAST`), as in the attention kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int


GPU_TILES = Tiles(64, 64, 32)
INTERPRETER_TILES = Tiles(16, 16, 16)  # small, so test shapes span several tiles


@triton.jit
def grouped_gemm_kernel(
    A, B, C, weights, sorted_slots, block_experts,
    N, K, num_slots, num_experts,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    A_PER_TOKEN: tl.constexpr, TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """C[slot, n-block] = A[row of slot] @ B[expert].T for one BLOCK_M tile of sorted slots.

    A rows are tokens (A_PER_TOKEN: slot // TOP_K) or slots; padding slots (== num_slots) are
    masked; a tile past the last expert's run (expert == num_experts) does nothing.
    """
    tile = tl.program_id(0)
    expert = tl.load(block_experts + tile).to(tl.int64)
    if expert >= num_experts:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots + offs_m).to(tl.int64)
    m_mask = slots < num_slots
    rows = slots // TOP_K if A_PER_TOKEN else slots
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        w = tl.load(weights + slots, mask=m_mask, other=0.0)
        acc = acc * w.to(tl.float32)[:, None]
    c_ptrs = C + slots[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


class Alignment(NamedTuple):
    sorted_slots: torch.Tensor  # [max_tiles * block_m]: slot ids, expert runs padded with num_slots
    block_experts: torch.Tensor  # [max_tiles]: each tile's expert; num_experts past the end


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Slots (token * k + j) sorted by expert, each expert's run padded to block_m rows; sized
    for the worst case (every expert's run padded), so nothing waits for the device."""
    flat = topk_ids.reshape(-1)
    num_slots = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    max_tiles = triton.cdiv(num_slots + num_experts * (block_m - 1), block_m)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    first = counts.cumsum(0) - counts  # each expert's first place in `order`
    dest = (padded_end - padded)[experts] + torch.arange(num_slots, device=flat.device) - \
        first[experts]
    sorted_slots = torch.full((max_tiles * block_m,), num_slots, dtype=torch.int32,
                              device=flat.device)
    sorted_slots[dest] = order.to(torch.int32)
    tile_starts = torch.arange(max_tiles, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_end, tile_starts, right=True).to(torch.int32)
    return Alignment(sorted_slots, block_experts)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, al: Alignment, num_slots: int, top_k: int,
                 a_per_token: bool, weights: torch.Tensor | None, tiles: Tiles) -> torch.Tensor:
    """[num_slots, N]: row s = a[s // top_k or s] @ w[expert of s].T (x weights[s])."""
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_slots, n, dtype=a.dtype, device=a.device)
    grid = (al.block_experts.numel(), triton.cdiv(n, tiles.block_n))
    grouped_gemm_kernel[grid](
        a, w, out, out if weights is None else weights, al.sorted_slots, al.block_experts,
        n, k, num_slots, w.shape[0],
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        A_PER_TOKEN=a_per_token, TOP_K=top_k, MUL_WEIGHT=weights is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        UPCAST=INTERPRETED, PRECISION="ieee" if a.dtype == torch.float32 else None,
    )
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """layers/moe.grouped_experts' result (w13 [E, 2I, H], w2 [E, H, I]; the routing's
    topk_ids and topk_weights [tokens, k]), on the GPU."""
    tiles = tiles or (INTERPRETER_TILES if INTERPRETED else GPU_TILES)
    tokens, top_k = ids.shape
    num_slots = tokens * top_k
    al = align(ids, w13.shape[0], tiles.block_m)
    x = x.contiguous()
    gate_up = grouped_gemm(x, w13, al, num_slots, top_k, True, None, tiles)
    gate, up = gate_up.chunk(2, dim=-1)
    h = (F.silu(gate) * up).contiguous()
    down = grouped_gemm(h, w2, al, num_slots, top_k, False,
                        weights.reshape(-1).contiguous(), tiles)
    return down.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
