"""The reference backend: torch ops only, padded batched SDPA, no Python loop over rows.

Decode rows (one new token) and extend rows (several) are two padded groups. Index matrices are
built once per step in `init_forward_metadata`; padding points at the reserved zero slot 0 and is
masked out. When every decode row starts with the same KV slots (a shared system prompt, the n
samples of one prompt: the radix cache hands out the same slots), that prefix is read once and
attended by all rows in one matmul (cascade), and only each row's own suffix is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hotswap.engine.attention.base import AttentionBackend
from hotswap.engine.forward_batch import ForwardBatch

# A shared decode prefix shorter than this is cheaper to gather per row than to split off.
CASCADE_MIN_PREFIX = 64


@dataclass
class _Group:
    q_index: torch.Tensor  # [G, Lq] flat token rows (padding repeats a valid row)
    q_valid: torch.Tensor | None  # [G, Lq] bool; None when nothing is padded
    kv_slots: torch.Tensor  # [G, Lk] pool slots (padding -> slot 0)
    mask: torch.Tensor  # [G, 1, Lq, Lk] bool, True = attend
    identity: bool  # the group is the whole batch in order, unpadded: no gather/scatter
    shared_slots: torch.Tensor | None = None  # [P] slots every row starts with (decode only)


@dataclass
class _Metadata:
    groups: list[_Group]


class TorchAttnBackend(AttentionBackend):
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        ext = torch.tensor(fb.extend_seq_lens_cpu)
        starts = ext.cumsum(0) - ext
        is_decode = ext == 1
        groups = []
        for rows in (is_decode.nonzero().flatten(), (~is_decode).nonzero().flatten()):
            if rows.numel():
                groups.append(self._build_group(fb, rows, starts, device))
        fb.attn_metadata = _Metadata(groups)

    def _build_group(self, fb: ForwardBatch, rows: torch.Tensor, starts: torch.Tensor,
                     device: torch.device) -> _Group:
        ext = torch.tensor(fb.extend_seq_lens_cpu)[rows]
        prefix = torch.tensor(fb.extend_prefix_lens_cpu)[rows]
        seq = prefix + ext
        lq, lk = int(ext.max()), int(seq.max())
        qpos = torch.arange(lq)
        q_valid = qpos[None, :] < ext[:, None]
        q_index = starts[rows][:, None] + torch.minimum(qpos[None, :], ext[:, None] - 1)
        table = self.req_to_token[fb.req_pool_indices[rows.to(device)], :lk]
        shared = _shared_prefix_len(table, int(seq.min())) if lq == 1 and len(rows) > 1 else 0
        shared_slots = None
        if shared >= CASCADE_MIN_PREFIX:
            shared_slots, table = table[0, :shared], table[:, shared:]
            prefix, seq, lk = prefix - shared, seq - shared, lk - shared
        kpos = torch.arange(lk)
        k_valid = kpos[None, :] < seq[:, None]
        kv_slots = torch.where(k_valid.to(device), table, torch.zeros_like(table))
        # query j of a row sits at absolute position prefix + j and sees keys at positions <= it
        causal = kpos[None, None, :] <= (prefix[:, None, None] + qpos[None, :, None])
        mask = causal & k_valid[:, None, :]
        identity = (q_valid.all() and q_index.numel() == fb.num_tokens
                    and bool((q_index.flatten() == torch.arange(fb.num_tokens)).all()))
        return _Group(
            shared_slots=shared_slots,
            identity=bool(identity),
            q_index=q_index.to(device),
            q_valid=None if bool(q_valid.all()) else q_valid.to(device),
            kv_slots=kv_slots,
            mask=mask[:, None].to(device),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        out = q.new_empty(q.shape)
        for g in fb.attn_metadata.groups:
            n, lq = g.q_index.shape
            qg = q if g.identity else q[g.q_index]
            qg = qg.reshape(n, lq, self.num_heads, self.head_dim).transpose(1, 2)
            kg = _gather(k_buf, g.kv_slots).transpose(1, 2)
            vg = _gather(v_buf, g.kv_slots).transpose(1, 2)
            if g.shared_slots is not None:
                og = self._cascade_decode(qg, kg, vg, g, k_buf, v_buf)
            else:
                og = F.scaled_dot_product_attention(
                    qg, kg, vg, attn_mask=g.mask, scale=self.scaling,
                    enable_gqa=self.num_heads != self.num_kv_heads)
            og = og.transpose(1, 2).reshape(n, lq, -1)
            if g.identity:
                return og.reshape(n * lq, -1)
            if g.q_valid is None:
                out[g.q_index.flatten()] = og.reshape(n * lq, -1)
            else:
                out[g.q_index[g.q_valid]] = og[g.q_valid]
        return out

    def _cascade_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: _Group,
                        k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
        """Decode attention over a shared prefix (read once) + each row's suffix, one softmax.

        q [n, Hq, 1, D]; k, v [n, Hkv, Lx, D] (the suffixes). Returns [n, Hq, 1, D].
        """
        n, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        qh = q.reshape(n, hkv, group, d)  # q head h reads kv head h // group
        kp = _gather(k_buf, g.shared_slots).permute(1, 2, 0)  # [Hkv, D, P]
        vp = _gather(v_buf, g.shared_slots).transpose(0, 1)  # [Hkv, P, D]
        flat_q = qh.transpose(0, 1).reshape(hkv, n * group, d)
        s_prefix = torch.bmm(flat_q, kp).view(hkv, n, group, -1).transpose(0, 1)
        s_suffix = torch.matmul(qh, k.transpose(-1, -2))  # [n, Hkv, G, Lx]
        s_suffix = s_suffix.masked_fill(~g.mask, float("-inf"))
        probs = (torch.cat((s_prefix, s_suffix), dim=-1).float() * self.scaling).softmax(-1)
        probs = probs.to(q.dtype)
        p_prefix, p_suffix = probs.split([kp.shape[-1], k.shape[2]], dim=-1)
        o_prefix = torch.bmm(p_prefix.transpose(0, 1).reshape(hkv, n * group, -1), vp)
        out = o_prefix.view(hkv, n, group, d).transpose(0, 1) + torch.matmul(p_suffix, v)
        return out.reshape(n, self.num_heads, 1, d)


def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf[slots] through index_select on a flat index: about 5x faster than advanced indexing
    on CPU for [64, 110] slots of [3, 64] rows."""
    return buf.index_select(0, slots.flatten()).view(*slots.shape, *buf.shape[1:])


def _shared_prefix_len(table: torch.Tensor, limit: int) -> int:
    """How many leading slots every row of `table` has in common (at most `limit`)."""
    same = (table[:, :limit] == table[:1, :limit]).all(0)
    return int(same.int().cumprod(0).sum())
