"""Triton backend: paged attention kernels that gather K/V through req_to_token themselves.

Decode rows (one new token) run through a split-K decode kernel and a reduce (flash-decoding);
extend rows run through a causal tile kernel over prefix + new tokens. A mixed batch launches
both, each writing its own rows of the output. Per-step tensors are built once in
`init_forward_metadata`; no padded index matrices exist, so padding never reads the pool.

On CPU the kernels only run under Triton's interpreter: TRITON_INTERPRET=1 must be set before
this module is first imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from hotswap.engine.attention import triton_kernels as kernels
from hotswap.engine.attention.base import AttentionBackend
from hotswap.engine.attention.triton_launch import (
    LaunchConfig,
    device_shared_memory,
    gpu_launch_config,
    interpreter_launch_config,
)
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.kvcache.memory import KVPool


@dataclass
class _DecodeMeta:
    q_rows: torch.Tensor  # [n] int32: flat token index of each decode row's query
    req_idx: torch.Tensor  # [n] int64: req_to_token row
    seq_lens: torch.Tensor  # [n] int32
    num_splits: int
    mid_o: torch.Tensor  # [n, num_heads, num_splits, head_dim] fp32, reused by every layer
    mid_lse: torch.Tensor  # [n, num_heads, num_splits] fp32


@dataclass
class _ExtendMeta:
    tile_row: torch.Tensor  # [tiles] int32: extend-group row of each BLOCK_M tile
    tile_block: torch.Tensor  # [tiles] int32: which tile of that row's new tokens
    q_starts: torch.Tensor  # [n] int32: flat index of the row's first new token
    prefix_lens: torch.Tensor  # [n] int32
    extend_lens: torch.Tensor  # [n] int32
    req_idx: torch.Tensor  # [n] int64


@dataclass
class _Metadata:
    decode: _DecodeMeta | None
    extend: _ExtendMeta | None


class TritonAttnBackend(AttentionBackend):
    max_kv_splits = 16
    min_split_tokens = 256  # fewer keys per split than this costs more in the reduce than it saves

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, scaling: float):
        super().__init__(kv_pool, req_to_token, num_heads, num_kv_heads, head_dim, scaling)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of {num_kv_heads}")
        device = kv_pool.device
        if device.type != "cuda" and not kernels.INTERPRETED:
            raise RuntimeError("the triton backend needs CUDA, or TRITON_INTERPRET=1 set before "
                               "hotswap.engine.attention.triton_kernels is imported")
        self.group = num_heads // num_kv_heads
        self.cfg = self._launch_config(device)
        self.qk_scale = scaling * kernels.LOG2E
        # tl.dot on fp32 defaults to tf32 on tensor cores; keep fp32 pools exact (None: default)
        self.precision = "ieee" if kv_pool.dtype == torch.float32 else None
        # split the keys only until the GPU is busy; on CPU only the length decides
        self.target_programs = (4 * torch.cuda.get_device_properties(device).multi_processor_count
                                if device.type == "cuda" else 1 << 30)

    def _launch_config(self, device: torch.device) -> LaunchConfig:
        if device.type != "cuda":
            return interpreter_launch_config(self.head_dim, self.group)
        return gpu_launch_config(self.kv_pool.dtype, self.head_dim, self.group,
                                 device_shared_memory(device))

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        ext = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int32)
        prefix = torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int32)
        starts = ext.cumsum(0, dtype=torch.int32) - ext
        is_decode = ext == 1
        decode_rows = is_decode.nonzero().flatten()
        extend_rows = (~is_decode).nonzero().flatten()
        fb.attn_metadata = _Metadata(
            decode=self._decode_meta(fb, decode_rows, starts, prefix) if decode_rows.numel()
            else None,
            extend=self._extend_meta(fb, extend_rows, starts, prefix, ext) if extend_rows.numel()
            else None,
        )

    def _decode_meta(self, fb: ForwardBatch, rows: torch.Tensor, starts: torch.Tensor,
                     prefix: torch.Tensor) -> _DecodeMeta:
        device = fb.input_ids.device
        n = rows.numel()
        seq_lens = prefix[rows] + 1
        num_splits = self._num_splits(n, int(seq_lens.max()))
        per_row = torch.stack([starts[rows], seq_lens]).to(device)
        return _DecodeMeta(
            q_rows=per_row[0],
            req_idx=fb.req_pool_indices[rows.to(device)],
            seq_lens=per_row[1],
            num_splits=num_splits,
            mid_o=torch.empty((n, self.num_heads, num_splits, self.head_dim), dtype=torch.float32,
                              device=device),
            mid_lse=torch.empty((n, self.num_heads, num_splits), dtype=torch.float32,
                                device=device),
        )

    def _num_splits(self, num_rows: int, max_seq_len: int) -> int:
        by_length = triton.cdiv(max_seq_len, self.min_split_tokens)
        by_occupancy = triton.cdiv(self.target_programs, num_rows * self.num_kv_heads)
        return max(1, min(self.max_kv_splits, by_length, by_occupancy))

    def _extend_meta(self, fb: ForwardBatch, rows: torch.Tensor, starts: torch.Tensor,
                     prefix: torch.Tensor, ext: torch.Tensor) -> _ExtendMeta:
        device = fb.input_ids.device
        bm = self.cfg.block_m
        ext, prefix = ext[rows], prefix[rows]
        tiles = (ext + bm - 1) // bm
        tile_row = torch.repeat_interleave(torch.arange(rows.numel(), dtype=torch.int32), tiles)
        first_tile = torch.repeat_interleave(tiles.cumsum(0) - tiles, tiles)
        tile_block = torch.arange(tile_row.numel(), dtype=torch.int32) - first_tile
        # heaviest tiles (most keys to read) first, so the long ones do not start last
        order = torch.argsort(prefix[tile_row] + tile_block * bm, descending=True, stable=True)
        per_tile = torch.stack([tile_row[order], tile_block[order]]).to(torch.int32).to(device)
        per_row = torch.stack([starts[rows], prefix, ext]).to(device)
        return _ExtendMeta(
            tile_row=per_tile[0],
            tile_block=per_tile[1],
            q_starts=per_row[0],
            prefix_lens=per_row[1],
            extend_lens=per_row[2],
            req_idx=fb.req_pool_indices[rows.to(device)],
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = q.new_empty((q.shape[0], self.num_heads * self.head_dim))
        meta = fb.attn_metadata
        if meta.decode is not None:
            self._run_decode(q, k_buf, v_buf, out, meta.decode)
        if meta.extend is not None:
            self._run_extend(q, k_buf, v_buf, out, meta.extend)
        return out

    def _run_decode(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                    out: torch.Tensor, meta: _DecodeMeta) -> None:
        cfg, n, splits = self.cfg, meta.q_rows.numel(), meta.num_splits
        mid_o, mid_lse = meta.mid_o, meta.mid_lse
        kernels.decode_split_kernel[(n, self.num_kv_heads, splits)](
            q, k_buf, v_buf, self.req_to_token, meta.q_rows, meta.req_idx, meta.seq_lens,
            mid_o, mid_lse,
            q.stride(0), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
            self.req_to_token.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            self.qk_scale, splits,
            HEAD_DIM=self.head_dim, GROUP=self.group, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
            BLOCK_D=cfg.block_d, UPCAST=kernels.INTERPRETED, PRECISION=self.precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        kernels.decode_reduce_kernel[(n, self.num_heads)](
            mid_o, mid_lse, out, meta.q_rows,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), splits,
            HEAD_DIM=self.head_dim, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=cfg.block_d,
            num_warps=cfg.num_warps,
        )

    def _run_extend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                    out: torch.Tensor, meta: _ExtendMeta) -> None:
        cfg = self.cfg
        kernels.extend_kernel[(meta.tile_row.numel(), self.num_heads)](
            q, k_buf, v_buf, out, self.req_to_token, meta.tile_row, meta.tile_block, meta.q_starts,
            meta.prefix_lens, meta.extend_lens, meta.req_idx,
            q.stride(0), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
            out.stride(0), self.req_to_token.stride(0),
            self.qk_scale,
            HEAD_DIM=self.head_dim, GROUP=self.group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_D=cfg.block_d, UPCAST=kernels.INTERPRETED, PRECISION=self.precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
