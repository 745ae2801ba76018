"""Paged attention kernels: split-K decode and causal extend, both reading K/V through req_to_token.

K/V live in per-layer pool buffers [num_slots, num_kv_heads, head_dim]; a row's token at position p
sits in slot `req_to_token[req, p]`, so every kernel gathers its keys slot by slot. Scores are kept
in log2 units (scale * log2(e) folded in) so the online softmax uses exp2. Softmax state and the
output accumulator are fp32 whatever the pool dtype.

Triton's interpreter (TRITON_INTERPRET=1, the CPU path) stores bfloat16 as raw uint16 and does
arithmetic and dot on the bit patterns, so under it every loaded operand is upcast to fp32 first
(`UPCAST`); compiled kernels keep the pool dtype for the tensor-core dots.
"""

from __future__ import annotations

import triton
import triton.language as tl

# triton.knobs arrived in triton 3.4, which torch 2.8 is the first to ship with.
MIN_TRITON = "3.4"
try:
    from triton import knobs
except ImportError as exc:
    raise ImportError(f"hotswap's Triton kernels need triton>={MIN_TRITON} (torch>=2.8); found "
                      f"triton {triton.__version__}: upgrade torch, or use "
                      "attention_backend='torch'") from exc

# Read when this module is imported, which is also when @triton.jit chooses interpreter or compiler.
INTERPRETED: bool = bool(knobs.runtime.interpret)
LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_block(buf, table, pos, n_mask, kv_head, offs_d, d_mask, stride_slot, stride_head):
    """Rows of `buf` for positions `pos` of one request: [BLOCK_N, BLOCK_D]."""
    slots = tl.load(table + pos, mask=n_mask, other=0)
    ptrs = buf + slots[:, None] * stride_slot + kv_head * stride_head + offs_d[None, :]
    return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def decode_split_kernel(
    Q, K_buf, V_buf, req_to_token, q_rows, req_idx, seq_lens, Mid_O, Mid_LSE,
    stride_qt, stride_ks, stride_kh, stride_vs, stride_vh, stride_rt,
    stride_mo_r, stride_mo_h, stride_mo_s, stride_ml_r, stride_ml_h,
    qk_scale, num_splits,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (row, kv head, split): the GROUP query heads sharing that kv head over one key range.

    Writes the split's normalised partial output and its log2-sum-exp; an empty split (short row)
    writes lse = -inf and a zero output so the reduce gives it no weight.
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + row)
    split_len = tl.cdiv(seq_len, num_splits)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q_row = tl.load(q_rows + row).to(tl.int64)
    q = tl.load(Q + q_row * stride_qt + heads[:, None] * HEAD_DIM + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32) if UPCAST else q.to(K_buf.dtype.element_ty)
    table = req_to_token + tl.load(req_idx + row).to(tl.int64) * stride_rt

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        k = _load_kv_block(K_buf, table, pos, n_mask, kv_head, offs_d, d_mask, stride_ks, stride_kh)
        v = _load_kv_block(V_buf, table, pos, n_mask, kv_head, offs_d, d_mask, stride_vs, stride_vh)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    mo = Mid_O + row * stride_mo_r + heads[:, None] * stride_mo_h + split * stride_mo_s
    tl.store(mo + offs_d[None, :], out, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(Mid_LSE + row * stride_ml_r + heads * stride_ml_h + split, lse, mask=h_mask)


@triton.jit
def decode_reduce_kernel(
    Mid_O, Mid_LSE, Out, q_rows,
    stride_mo_r, stride_mo_h, stride_mo_s, stride_ml_r, stride_ml_h, stride_ot,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (row, head): merge the split partials, each weighted by its share of the softmax mass."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(Mid_LSE + row * stride_ml_r + head * stride_ml_h + offs_s, mask=s_mask,
                  other=float("-inf"))
    # split 0 always holds keys (seq_len >= 1), so the max is finite
    w = tl.exp2(lse - tl.max(lse, 0))
    mo = Mid_O + row * stride_mo_r + head * stride_mo_h
    o = tl.load(mo + offs_s[:, None] * stride_mo_s + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    q_row = tl.load(q_rows + row).to(tl.int64)
    tl.store(Out + q_row * stride_ot + head * HEAD_DIM + offs_d,
             out.to(Out.dtype.element_ty), mask=d_mask)


@triton.jit
def extend_kernel(
    Q, K_buf, V_buf, Out, req_to_token, tile_row, tile_block, q_starts, prefix_lens, extend_lens,
    req_idx,
    stride_qt, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_rt,
    qk_scale,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (tile, query head): BLOCK_M new tokens of one row against the row's keys up to them.

    The new tokens' K/V are already in the pool, so prefix and new keys are read the same way;
    query j of a row sits at position prefix + j and sees keys at positions <= that.
    """
    tile = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(tile_row + tile)
    block = tl.load(tile_block + tile)
    prefix = tl.load(prefix_lens + row)
    ext = tl.load(extend_lens + row)
    kv_head = head // GROUP

    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < ext
    d_mask = offs_d < HEAD_DIM
    tokens = tl.load(q_starts + row).to(tl.int64) + offs_m
    q = tl.load(Q + tokens[:, None] * stride_qt + head * HEAD_DIM + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32) if UPCAST else q.to(K_buf.dtype.element_ty)
    table = req_to_token + tl.load(req_idx + row).to(tl.int64) * stride_rt
    q_pos = prefix + offs_m
    end = tl.minimum(prefix + ext, prefix + (block + 1) * BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # the first key block holds position 0, visible to every query, so m_i is finite after it
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        k = _load_kv_block(K_buf, table, pos, n_mask, kv_head, offs_d, d_mask, stride_ks, stride_kh)
        v = _load_kv_block(V_buf, table, pos, n_mask, kv_head, offs_d, d_mask, stride_vs, stride_vh)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(Out + tokens[:, None] * stride_ot + head * HEAD_DIM + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
