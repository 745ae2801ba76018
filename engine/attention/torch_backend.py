"""The reference backend: torch ops only, padded batched SDPA, no Python loop over rows.

Decode rows (one new token) and extend rows (several) are two padded groups. Index matrices are
built once per step in `init_forward_metadata`; padding points at the reserved zero slot 0 and is
masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hotswap.engine.attention.base import AttentionBackend
from hotswap.engine.forward_batch import ForwardBatch


@dataclass
class _Group:
    q_index: torch.Tensor  # [G, Lq] flat token rows (padding repeats a valid row)
    q_valid: torch.Tensor | None  # [G, Lq] bool; None when nothing is padded
    kv_slots: torch.Tensor  # [G, Lk] pool slots (padding -> slot 0)
    mask: torch.Tensor  # [G, 1, Lq, Lk] bool, True = attend
    identity: bool  # the group is the whole batch in order, unpadded: no gather/scatter


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
        kpos = torch.arange(lk)
        k_valid = kpos[None, :] < seq[:, None]
        table = self.req_to_token[fb.req_pool_indices[rows.to(device)], :lk]
        kv_slots = torch.where(k_valid.to(device), table, torch.zeros_like(table))
        # query j of a row sits at absolute position prefix + j and sees keys at positions <= it
        causal = kpos[None, None, :] <= (prefix[:, None, None] + qpos[None, :, None])
        mask = causal & k_valid[:, None, :]
        identity = (q_valid.all() and q_index.numel() == fb.num_tokens
                    and bool((q_index.flatten() == torch.arange(fb.num_tokens)).all()))
        return _Group(
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
            kg = k_buf[g.kv_slots].transpose(1, 2)
            vg = v_buf[g.kv_slots].transpose(1, 2)
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scaling,
                                                enable_gqa=self.num_heads != self.num_kv_heads)
            og = og.transpose(1, 2).reshape(n, lq, -1)
            if g.identity:
                return og.reshape(n * lq, -1)
            if g.q_valid is None:
                out[g.q_index.flatten()] = og.reshape(n * lq, -1)
            else:
                out[g.q_index[g.q_valid]] = og[g.q_valid]
        return out
