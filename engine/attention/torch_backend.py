"""The CPU backend (and the reference elsewhere): no Python loop over rows.

On the CPU, where layers/cpu_kernels.py is built, decode rows run its fused paged-attention
kernel over the pool itself, and so do extend rows (a query per token; on AMX CPUs short ones
only, see AMX_EXTEND_MAX_KEYS); a step with only such rows runs every layer as one fused call
(see fused_decode_inputs). What follows is the torch-ops path, for the other extend rows and
for decode rows elsewhere.

Decode rows (one new token) and extend rows (several) are handled apart. Extend rows run one
padded SDPA with a causal mask. Decode rows run as batched matmuls over (row, kv head) pairs:
the pool is read as rows of [head_dim], gathered straight into [rows * kv_heads, keys, head_dim]
so no copy or padded mask expansion sits between the gather and the matmuls (about twice as
fast as SDPA for one query per row on CPU). Index tensors are built once per step in
`init_forward_metadata`; padding points at the reserved zero slot 0 and is masked out. When
every decode row starts with the same KV slots (a shared system prompt, the n samples of one
prompt: the radix cache hands out the same slots), that prefix is read once and attended by all
rows in one matmul (cascade), and only each row's own suffix is gathered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hotswap.engine.attention.base import AttentionBackend, FusedDecodeInputs
from hotswap.engine.core.forward_batch import ForwardBatch, ForwardMode, flat_ranges
from hotswap.engine.layers import cpu_kernels
from hotswap.engine.layers.linear import AMX_BF16

# A shared decode prefix shorter than this is cheaper to gather per row than to split off.
CASCADE_MIN_PREFIX = 64
# Decode attention over at most this many gathered KV rows (rows x kv heads x keys) runs in
# float32 in a bf16/fp16 model: there the batched matmuls are dominated by their per-call cost,
# which is ~4x lower in float32 on CPU (measured: 1 row x 3 kv heads x 100 keys, 35 us against
# 67 us for scores + softmax + weighted sum; 8 rows, 71 against 92 us; at 16 rows bf16 wins).
DECODE_FP32_MAX_ROWS = 2400
# On the CPU kernel, extend rows run as one query per token instead of in a padded SDPA call:
# every row, except in a bf16/fp16 pool on a CPU with AMX, whose SDPA matmuls win past 128 keys
# (measured, 2 threads, 30 layers' worth: 64 rows of 42 tokens, bf16 2.5 against 6.7 ms a
# layer, fp32 2.7 against 7.3; on an AMX CPU at 128-200 keys bf16 SDPA won by ~1.3x, fp32 SDPA
# lost up to ~1,000 keys). Without AMX the kernel won (bench/extend.py on an EPYC with
# AVX512-BF16, prefills, verify steps and questions after a cached prompt: bf16 1.27-2.56x,
# float32 1.10-1.79x; under the AVX2 switch float32 1.04-1.50x, bf16 0.86-1.88x,
# docs/performance.md#prefill-through-the-decode-kernel).
AMX_EXTEND_MAX_KEYS = 128
# Extend rows share one padded SDPA call while padding adds at most half the useful
# query x key work, or any amount under PADDING_FREE (small calls cost their overhead).
PADDING_SLACK = 1.5
PADDING_FREE = 64 * 1024


@dataclass
class _Decode:
    tokens: torch.Tensor | None  # [n] flat token of each query; None: the whole batch, in order
    fused: _FusedDecode | None  # the CPU kernel's inputs; None: the torch ops below
    kv_rows: torch.Tensor | None = None  # [n * Hkv * Lk] rows of the pool as [slots * Hkv, D]
    bias: torch.Tensor | None = None  # [n * Hkv, heads per kv head, Lk]: 0 if seen, else -inf
    shared_rows: torch.Tensor | None = None  # [Hkv * P] pool rows of the prefix all rows share
    upcast: bool = False  # compute in float32 (a small decode batch of a bf16/fp16 model)


@dataclass
class _FusedDecode:
    req_idx: torch.Tensor  # [n] int64 rows of req_to_token, one per query token
    seq_lens: torch.Tensor  # [n] int64 keys each query sees, its own token included


@dataclass
class _Extend:
    q_index: torch.Tensor  # [B, Lq] flat token rows (padding repeats a valid row)
    q_valid: torch.Tensor | None  # [B, Lq] bool; None when nothing is padded
    kv_slots: torch.Tensor  # [B, Lk] pool slots (padding -> slot 0)
    mask: torch.Tensor  # [B, 1, Lq, Lk] bool, True = attend
    identity: bool  # the rows are the whole batch in order, unpadded: no gather/scatter


@dataclass
class _Metadata:
    decode: _Decode | None
    extend: list[_Extend]


class TorchAttnBackend(AttentionBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Decode rows on the CPU run one fused kernel: no gathered copy, no padding, no bias. It
        # reads a shared prefix once per row and still beats the cascade below (measured, bf16,
        # 2 threads: 64 rows sharing 1,024 tokens 1.3 ms against 2.9; 8 rows, 0.18 against 0.30).
        pool = self.kv_pool
        self.fused_decode = (pool.device.type == "cpu" and pool.dtype in cpu_kernels.DTYPES
                             and cpu_kernels.available())
        self.extend_max_keys = (AMX_EXTEND_MAX_KEYS if AMX_BF16 and pool.dtype != torch.float32
                                else math.inf)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if self.fused_decode and fb.mode is ForwardMode.DECODE:  # a query per row, in order
            fb.attn_metadata = _Metadata(_Decode(None, _FusedDecode(fb.req_pool_indices,
                                                                    fb.seq_lens)), [])
            return
        ext = torch.tensor(fb.extend_seq_lens_cpu)
        prefix = torch.tensor(fb.extend_prefix_lens_cpu)
        starts = ext.cumsum(0) - ext
        is_decode = ext == 1
        if self.fused_decode:  # extend rows too, each token a query of the kernel
            # Batch-invariant: every row, so that a token's attention has the same bits whether
            # its context came from a prefill, a chunk, decode steps or the prefix cache.
            is_decode |= (prefix + ext <= self.extend_max_keys) | self.batch_invariant
        decode_rows, extend_rows = is_decode.nonzero().flatten(), (~is_decode).nonzero().flatten()
        decode = (self._build_decode(fb, decode_rows, prefix, ext, starts)
                  if decode_rows.numel() else None)
        fb.attn_metadata = _Metadata(decode, [
            self._build_extend(fb, rows, prefix, ext, starts)
            for rows in _padding_groups(extend_rows, ext, prefix + ext)])

    def _table(self, fb: ForwardBatch, rows: torch.Tensor, width: int) -> torch.Tensor:
        return self.req_to_token[fb.req_pool_indices[rows.to(fb.input_ids.device)], :width]

    def _build_decode(self, fb: ForwardBatch, rows: torch.Tensor, prefix: torch.Tensor,
                      ext: torch.Tensor, starts: torch.Tensor) -> _Decode:
        device, hkv = fb.input_ids.device, self.num_kv_heads
        if self.fused_decode:
            # A query per token: token j of a row sees its prefix and the row's tokens <= j.
            counts = ext[rows]
            tokens = flat_ranges(starts[rows], counts)
            seq = flat_ranges(prefix[rows] + 1, counts)
            req_idx = torch.repeat_interleave(fb.req_pool_indices[rows.to(device)],
                                              counts.to(device))
            whole = len(tokens) == fb.num_tokens  # then in order: rows are sorted, tokens too
            return _Decode(None if whole else tokens.to(device),
                           _FusedDecode(req_idx.to(torch.int64), seq.to(device)))
        n, seq = len(rows), prefix[rows] + 1
        tokens = None if n == fb.batch_size else starts[rows].to(device)
        table = self._table(fb, rows, int(seq.max()))
        shared = _shared_prefix_len(table, int(seq.min())) if n > 1 else 0
        shared_rows = None
        if shared >= CASCADE_MIN_PREFIX:
            shared_rows = _pool_rows(table[0, :shared], hkv).flatten()
            table, seq = table[:, shared:], seq - shared
        valid = (torch.arange(table.shape[1])[None, :] < seq[:, None]).to(device)
        slots = torch.where(valid, table, torch.zeros_like(table))
        upcast = (shared_rows is None and self.kv_pool.dtype != torch.float32
                  and device.type == "cpu" and n * hkv * table.shape[1] <= DECODE_FP32_MAX_ROWS)
        bias = torch.zeros(n, 1, 1, table.shape[1], device=device,
                           dtype=torch.float32 if upcast else self.kv_pool.dtype)
        bias.masked_fill_(~valid[:, None, None, :], float("-inf"))
        group = self.num_heads // hkv
        return _Decode(
            tokens=tokens,
            fused=None,
            kv_rows=_pool_rows(slots, hkv).flatten(),
            bias=bias.expand(n, hkv, group, -1).reshape(n * hkv, group, -1),
            shared_rows=shared_rows,
            upcast=upcast,
        )

    def _build_extend(self, fb: ForwardBatch, rows: torch.Tensor, prefix: torch.Tensor,
                      ext: torch.Tensor, starts: torch.Tensor) -> _Extend:
        device = fb.input_ids.device
        ext, prefix = ext[rows], prefix[rows]
        seq = prefix + ext
        lq, lk = int(ext.max()), int(seq.max())
        qpos = torch.arange(lq)
        q_valid = qpos[None, :] < ext[:, None]
        q_index = starts[rows][:, None] + torch.minimum(qpos[None, :], ext[:, None] - 1)
        table = self._table(fb, rows, lk)
        kpos = torch.arange(lk)
        k_valid = kpos[None, :] < seq[:, None]
        kv_slots = torch.where(k_valid.to(device), table, torch.zeros_like(table))
        # query j of a row sits at absolute position prefix + j and sees keys at positions <= it
        causal = kpos[None, None, :] <= (prefix[:, None, None] + qpos[None, :, None])
        mask = causal & k_valid[:, None, :]
        identity = (q_valid.all() and q_index.numel() == fb.num_tokens
                    and bool((q_index.flatten() == torch.arange(fb.num_tokens)).all()))
        return _Extend(
            identity=bool(identity),
            q_index=q_index.to(device),
            q_valid=None if bool(q_valid.all()) else q_valid.to(device),
            kv_slots=kv_slots,
            mask=mask[:, None].to(device),
        )

    def fused_decode_inputs(self, fb: ForwardBatch) -> FusedDecodeInputs | None:
        meta = fb.attn_metadata
        if meta.extend or meta.decode.tokens is not None or meta.decode.fused is None:
            return None
        pool, fused = self.kv_pool, meta.decode.fused
        return FusedDecodeInputs(pool.k_buffers, pool.v_buffers, fb.out_cache_loc,
                                 self.req_to_token, fused.req_idx, fused.seq_lens, self.scaling)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        meta = fb.attn_metadata
        if not meta.extend and meta.decode.tokens is None:
            return self._decode(q, k_buf, v_buf, meta.decode)
        out = q.new_empty(q.shape)
        if meta.decode is not None:
            out[meta.decode.tokens] = self._decode(q[meta.decode.tokens], k_buf, v_buf,
                                                   meta.decode)
        for group in meta.extend:
            self._extend(q, k_buf, v_buf, group, out)
        return out

    def _extend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, g: _Extend,
                out: torch.Tensor) -> None:
        n, lq = g.q_index.shape
        qg = q if g.identity else q[g.q_index]
        qg = qg.reshape(n, lq, self.num_heads, self.head_dim).transpose(1, 2)
        kg = _gather(k_buf, g.kv_slots).transpose(1, 2)
        vg = _gather(v_buf, g.kv_slots).transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scaling,
                                            enable_gqa=self.num_heads != self.num_kv_heads)
        og = og.transpose(1, 2).reshape(n, lq, -1)
        if g.identity:
            out.copy_(og.reshape(n * lq, -1))
        elif g.q_valid is None:
            out[g.q_index.flatten()] = og.reshape(n * lq, -1)
        else:
            out[g.q_index[g.q_valid]] = og[g.q_valid]

    def _decode(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, g: _Decode
                ) -> torch.Tensor:
        """q [n, Hq * D] -> [n, Hq * D]; query head h reads kv head h // group."""
        if g.fused is not None:
            return cpu_kernels.decode_attention(q, k_buf, v_buf, self.req_to_token,
                                                g.fused.req_idx, g.fused.seq_lens, self.scaling)
        n, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        qh = q.reshape(n * hkv, group, d)
        k_rows, v_rows = k_buf.view(-1, d), v_buf.view(-1, d)
        ks = k_rows.index_select(0, g.kv_rows).view(n * hkv, -1, d)
        vs = v_rows.index_select(0, g.kv_rows).view(n * hkv, -1, d)
        if g.upcast:
            scores = torch.baddbmm(g.bias, qh.float(), ks.float().transpose(1, 2),
                                   alpha=self.scaling)
            return torch.bmm(torch.softmax(scores, -1), vs.float()).to(q.dtype).view(n, -1)
        scores = torch.baddbmm(g.bias, qh, ks.transpose(1, 2), alpha=self.scaling)
        if g.shared_rows is None:
            return torch.bmm(_softmax(scores, q.dtype), vs).view(n, -1)
        # Cascade: the shared prefix's keys are read once, as [Hkv, P, D], for all n rows.
        kp = k_rows.index_select(0, g.shared_rows).view(hkv, -1, d)
        vp = v_rows.index_select(0, g.shared_rows).view(hkv, -1, d)
        p = kp.shape[1]
        q_by_head = qh.view(n, hkv, group, d).transpose(0, 1).reshape(hkv, n * group, d)
        s_prefix = torch.bmm(q_by_head, kp.transpose(1, 2)).mul_(self.scaling)
        s_prefix = s_prefix.view(hkv, n, group, p).transpose(0, 1).reshape(n * hkv, group, p)
        probs = _softmax(torch.cat((s_prefix, scores), dim=-1), q.dtype)
        p_prefix, p_suffix = probs.split([p, scores.shape[-1]], dim=-1)
        p_by_head = p_prefix.reshape(n, hkv, group, p).transpose(0, 1).reshape(hkv, n * group, p)
        o_prefix = torch.bmm(p_by_head, vp).view(hkv, n, group, d).transpose(0, 1)
        out = torch.bmm(p_suffix, vs).view(n, hkv, group, d) + o_prefix
        return out.reshape(n, -1)


def _padding_groups(rows: torch.Tensor, ext: torch.Tensor, seq: torch.Tensor
                    ) -> list[torch.Tensor]:
    """Split extend rows into padded SDPA calls that waste little.

    One call pads every row to the longest query and key lengths of the call, so a 1,000-token
    prompt next to short ones (a shared prompt and the requests that borrow it, admitted in one
    step) would multiply the work. Rows go in order of decreasing work; a row joins the current
    call while the padded work stays within PADDING_SLACK of the useful work (plus
    PADDING_FREE for calls too small to matter)."""
    if rows.numel() <= 1:
        return [rows] if rows.numel() else []
    work = ext[rows] * seq[rows]
    order = rows[torch.argsort(work, descending=True, stable=True)].tolist()
    groups, current, useful, max_q, max_k = [], [], 0, 0, 0
    for row in order:
        q, k = int(ext[row]), int(seq[row])
        mq, mk = max(max_q, q), max(max_k, k)
        padded = (len(current) + 1) * mq * mk
        if current and padded > PADDING_SLACK * (useful + q * k) + PADDING_FREE:
            groups.append(current)
            current, useful, mq, mk = [], 0, q, k
        current.append(row)
        useful, max_q, max_k = useful + q * k, mq, mk
    groups.append(current)
    return [torch.tensor(sorted(g)) for g in groups]


def _softmax(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax in float32 (one conversion in, one out for bf16; none for float32)."""
    return torch.softmax(scores, -1, dtype=torch.float32).to(dtype)


def _pool_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., L] slots -> [..., Hkv, L] rows of the pool viewed as [slots * Hkv, head_dim]."""
    heads = torch.arange(num_kv_heads, device=slots.device)
    return slots.unsqueeze(-2) * num_kv_heads + heads[:, None]


def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf[slots] through index_select on a flat index: about 5x faster than advanced indexing
    on CPU for [64, 110] slots of [3, 64] rows."""
    return buf.index_select(0, slots.flatten()).view(*slots.shape, *buf.shape[1:])


def _shared_prefix_len(table: torch.Tensor, limit: int) -> int:
    """How many leading slots every row of `table` has in common (at most `limit`)."""
    same = (table[:, :limit] == table[:1, :limit]).all(0)
    return int(same.int().cumprod(0).sum())
