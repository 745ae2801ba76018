"""The FlashInfer backend (CUDA only): paged-KV decode and causal append kernels.

Written against flashinfer-python 0.7.4; the calls used here (the wrappers' constructors, `plan`
with keyword options, `run(q, (k_cache, v_cache))`) have kept their names since 0.2. The softmax
scale is given to `plan`, which caches it for every `run` of the step.

The pool's per-layer buffer [num_slots, num_kv_heads, head_dim] is viewed, without a copy, as
[num_pages + 1, page_size, num_kv_heads, head_dim], FlashInfer's NHD paged layout. A request's
tokens fill its pages in order, so page j of a row holds tokens j * page_size onwards and the
slot of that first token names the page.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from hotswap.engine.attention.base import AttentionBackend
from hotswap.engine.core.forward_batch import ForwardBatch, ForwardMode
from hotswap.engine.kvcache.memory import KVPool

WORKSPACE_BYTES = 128 * 1024 * 1024
UNAVAILABLE = ("flashinfer backend needs CUDA and the flashinfer package; "
               "use attention_backend='torch'")
# The CUDA-core decode kernel is compiled for groups of up to 4 query heads per KV head (and a
# few larger ones); wider groups run faster on the tensor-core path anyway.
MAX_CUDA_CORE_GQA_GROUP = 4


class PagedKVIndices(NamedTuple):
    """One step's page table in FlashInfer's CSR form."""

    qo_indptr: torch.Tensor  # [B + 1] int32, CPU: row i's new tokens are q[qo_indptr[i]:...[i+1]]
    kv_indptr: torch.Tensor  # [B + 1] int32, CPU: row i's pages are kv_indices[kv_indptr[i]:...]
    kv_indices: torch.Tensor  # [num pages used] int32, on req_to_token's device
    kv_last_page_len: torch.Tensor  # [B] int32, CPU: tokens on each row's last page, 1..page_size


def build_paged_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                           seq_lens: list[int], extend_lens: list[int],
                           page_size: int) -> PagedKVIndices:
    """Page ids of every row: `req_to_token[row, 0:seq_len:page_size] // page_size`, flattened.

    Lengths come from host lists so that only the page-id gather touches the device.
    """
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    ext = torch.tensor(extend_lens, dtype=torch.int64)
    pages = (seq + page_size - 1) // page_size
    kv_indptr = _indptr(pages)
    total = int(kv_indptr[-1])
    page_in_row = torch.arange(total) - kv_indptr[:-1].repeat_interleave(pages)
    device = req_to_token.device
    rows = req_pool_indices.to(device).repeat_interleave(pages.to(device), output_size=total)
    first_slots = req_to_token[rows, (page_in_row * page_size).to(device)]
    return PagedKVIndices(
        qo_indptr=_indptr(ext).to(torch.int32),
        kv_indptr=kv_indptr.to(torch.int32),
        kv_indices=(first_slots // page_size).to(torch.int32),
        kv_last_page_len=(seq - (pages - 1) * page_size).to(torch.int32),
    )


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def paged_view(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """[num_slots, H, D] -> [num_slots // page_size, page_size, H, D], sharing storage."""
    return buffer.view(-1, page_size, *buffer.shape[1:])


def _cuda_ready(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(UNAVAILABLE) from exc
    return flashinfer


class FlashInferAttnBackend(AttentionBackend):
    """Decode-only steps use the decode wrapper; any step with an extend row uses the causal
    prefill wrapper, where a decode row is simply an extend row of length 1."""

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, scaling: float):
        super().__init__(kv_pool, req_to_token, num_heads, num_kv_heads, head_dim, scaling)
        if not _cuda_ready(kv_pool.device):
            raise RuntimeError(UNAVAILABLE)
        flashinfer = _import_flashinfer()
        if kv_pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flashinfer backend needs a float16 or bfloat16 KV cache, "
                             f"got {kv_pool.dtype}")
        # One float workspace serves both wrappers: a step runs only one of them.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        group = num_heads // num_kv_heads
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=group > MAX_CUDA_CORE_GQA_GROUP)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD")

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        ps = self.kv_pool.page_size
        idx = build_paged_kv_indices(self.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu,
                                     fb.extend_seq_lens_cpu, ps)
        dtypes = {"q_data_type": self.kv_pool.dtype, "kv_data_type": self.kv_pool.dtype}
        if fb.mode == ForwardMode.DECODE:
            self.decode_wrapper.plan(
                idx.kv_indptr, idx.kv_indices, idx.kv_last_page_len, self.num_heads,
                self.num_kv_heads, self.head_dim, ps, sm_scale=self.scaling, **dtypes)
            fb.attn_metadata = self.decode_wrapper
        else:
            self.prefill_wrapper.plan(
                idx.qo_indptr, idx.kv_indptr, idx.kv_indices, idx.kv_last_page_len,
                self.num_heads, self.num_kv_heads, self.head_dim, ps, causal=True,
                sm_scale=self.scaling, **dtypes)
            fb.attn_metadata = self.prefill_wrapper

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        ps = self.kv_pool.page_size
        cache = (paged_view(self.kv_pool.k_buffers[layer_id], ps),
                 paged_view(self.kv_pool.v_buffers[layer_id], ps))
        out = fb.attn_metadata.run(q.contiguous().view(-1, self.num_heads, self.head_dim), cache)
        return out.view(-1, self.num_heads * self.head_dim)
