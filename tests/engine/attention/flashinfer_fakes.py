"""CPU stand-ins for flashinfer's paged-KV wrappers, bound to the real signatures.

Every call is bound (`inspect.Signature.bind`) against the parameter lists recorded below from
flashinfer-python 0.7.4 (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper);
test_flashinfer_backend.py checks the record against the installed package wherever it imports.
`run` computes attention from the page table `plan` was given, the way the kernels read it, so
a wrong plan argument shows up as a wrong output or a refused call, as it would on a GPU.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch

VERSION = "0.7.4"
# flashinfer/data/include/flashinfer/utils.cuh DISPATCH_GQA_GROUP_SIZE: the CUDA-core decode
# kernels exist for these query heads per KV head only.
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 6, 8, 16)


# The parameter lists of flashinfer-python 0.7.4, generated with inspect.signature.
class DecodeSignatures:
    def __init__(self, float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend='auto', jit_args=None, jit_kwargs=None): ...

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *deprecated_positional_args, **kwargs): ...

    def _plan_impl(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, *, pos_encoding_mode='NONE', window_left=-1, window_right=0,
                   logits_soft_cap=None, q_data_type='float16', kv_data_type=None,
                   o_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
                   rope_theta=None, non_blocking=True, block_tables=None, seq_lens=None,
                   fixed_split_size=None, disable_split_kv=False, q_len_per_req=1,
                   is_causal=None, use_token_head_sf=False): ...

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse=False, enable_pdl=None, window_left=None, sinks=None,
            q_len_per_req=None, skip_softmax_threshold_scale_factor=None,
            kv_cache_sf=None): ...


class PrefillSignatures:
    def __init__(self, float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend='auto', jit_args=None, jit_kwargs=None, variant_owns_mask=False,
                 max_total_num_rows=None): ...

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode='NONE',
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type='float16', kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None,
             token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None,
             seq_lens=None, seq_lens_q=None, block_tables=None, max_token_per_sequence=None,
             max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False,
             uniform_q_len=None, use_token_head_sf=False): ...

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse=False, lse_base='log2', lse_layout='NH', enable_pdl=None,
            window_left=None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
            uses_spcompress=None): ...


RECORDED = {
    "BatchDecodeWithPagedKVCacheWrapper": DecodeSignatures,
    "BatchPrefillWithPagedKVCacheWrapper": PrefillSignatures,
}


def bind(recorded: type, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The call's arguments by name, defaults applied; TypeError as the real method would raise.

    Decode's `plan` forwards **kwargs to `_plan_impl`, so those are bound there too."""
    sig = inspect.signature(getattr(recorded, method))
    bound = sig.bind(None, *args, **kwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    if out.pop("deprecated_positional_args", ()):
        raise AssertionError("positional plan options are deprecated in flashinfer 0.7")
    extra = out.pop("kwargs", None)
    if extra is not None:
        out = bind(recorded, "_plan_impl", *[out[k] for k in list(out)[1:]], **extra)
    out.pop("self", None)
    return out


def _dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    return getattr(torch, value) if isinstance(value, str) else value


class _FakeWrapper:
    recorded: type

    def __init__(self, *args: Any, **kwargs: Any):
        self.init_args = bind(self.recorded, "__init__", *args, **kwargs)
        assert self.init_args["kv_layout"] == "NHD"
        self.plan_args: dict[str, Any] | None = None
        self.plans = 0

    def _check_table(self, indptr: torch.Tensor, indices: torch.Tensor,
                     last_page_len: torch.Tensor, page_size: int) -> None:
        for t in (indptr, indices, last_page_len):
            assert t.dtype == torch.int32, f"page-table tensors are int32, got {t.dtype}"
        assert indptr.numel() == last_page_len.numel() + 1 and int(indptr[0]) == 0
        assert bool((indptr.diff() >= 1).all()), "every row has at least one page"
        assert indices.numel() == int(indptr[-1])
        assert bool(((last_page_len >= 1) & (last_page_len <= page_size)).all())

    def run(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        call = bind(self.recorded, "run", *args, **kwargs)
        assert self.plan_args is not None, "run before plan"
        p = self.plan_args
        q, cache = call["q"], call["paged_kv_cache"]
        k_cache, v_cache = cache
        hq, hkv, d, ps = p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], p["page_size"]
        assert q.dim() == 3 and q.shape[1:] == (hq, d), f"q {tuple(q.shape)} vs plan {hq}x{d}"
        assert q.shape[0] == self.num_queries, f"q has {q.shape[0]} rows, plan {self.num_queries}"
        assert q.dtype == p["q_dtype"], f"q is {q.dtype}, plan said {p['q_dtype']}"
        for c in (k_cache, v_cache):
            assert c.dim() == 4 and c.shape[1:] == (ps, hkv, d), f"cache {tuple(c.shape)}"
            assert c.dtype == p["kv_dtype"], f"cache is {c.dtype}, plan said {p['kv_dtype']}"
        assert int(p["indices"].max()) < k_cache.shape[0]
        return attend(q, k_cache, v_cache, p, self.qo_indptr, causal=p["causal"])


class FakeDecodeWrapper(_FakeWrapper):
    recorded = DecodeSignatures

    def plan(self, *args: Any, **kwargs: Any) -> None:
        a = bind(self.recorded, "plan", *args, **kwargs)
        self._check_table(a["indptr"], a["indices"], a["last_page_len"], a["page_size"])
        group = a["num_qo_heads"] // a["num_kv_heads"]
        assert a["num_qo_heads"] % a["num_kv_heads"] == 0
        if not self.init_args["use_tensor_cores"]:
            assert group in CUDA_CORE_DECODE_GROUPS, f"Unsupported group_size: {group}"
        batch = a["last_page_len"].numel()
        self.num_queries = batch
        self.qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
        self.plan_args = _plan_summary(a, a["indptr"], a["indices"], a["last_page_len"],
                                       a["head_dim"], causal=False)
        self.plans += 1


class FakePrefillWrapper(_FakeWrapper):
    recorded = PrefillSignatures

    def plan(self, *args: Any, **kwargs: Any) -> None:
        a = bind(self.recorded, "plan", *args, **kwargs)
        self._check_table(a["paged_kv_indptr"], a["paged_kv_indices"],
                          a["paged_kv_last_page_len"], a["page_size"])
        qo = a["qo_indptr"]
        assert qo.dtype == torch.int32 and qo.numel() == a["paged_kv_indptr"].numel()
        assert a["num_qo_heads"] % a["num_kv_heads"] == 0
        self.num_queries = int(qo[-1])
        self.qo_indptr = qo
        self.plan_args = _plan_summary(a, a["paged_kv_indptr"], a["paged_kv_indices"],
                                       a["paged_kv_last_page_len"], a["head_dim_qk"],
                                       causal=a["causal"])
        self.plans += 1


def _plan_summary(a: dict[str, Any], indptr: torch.Tensor, indices: torch.Tensor,
                  last: torch.Tensor, head_dim: int, causal: bool) -> dict[str, Any]:
    q_dtype = _dtype(a["q_data_type"])
    scale = a["sm_scale"]
    return {**a, "indptr": indptr, "indices": indices, "last_page_len": last,
            "head_dim": head_dim, "causal": causal, "q_dtype": q_dtype,
            "kv_dtype": _dtype(a["kv_data_type"]) or q_dtype,
            "o_dtype": _dtype(a["o_data_type"]) or q_dtype,
            "scale": head_dim ** -0.5 if scale is None else scale}


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: dict[str, Any],
           qo_indptr: torch.Tensor, causal: bool) -> torch.Tensor:
    """Row i's queries against the keys on its pages, in float32; causal aligned to the end."""
    ps, group = p["page_size"], p["num_qo_heads"] // p["num_kv_heads"]
    out = torch.empty(q.shape, dtype=p["o_dtype"], device=q.device)
    for i in range(qo_indptr.numel() - 1):
        pages = p["indices"][int(p["indptr"][i]): int(p["indptr"][i + 1])].long()
        n_keys = (pages.numel() - 1) * ps + int(p["last_page_len"][i])
        k = k_cache[pages].flatten(0, 1)[:n_keys].float().repeat_interleave(group, 1)
        v = v_cache[pages].flatten(0, 1)[:n_keys].float().repeat_interleave(group, 1)
        lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k) * p["scale"]
        if causal:
            q_pos = torch.arange(n_keys - (hi - lo), n_keys)
            hidden = torch.arange(n_keys)[None, :] > q_pos[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(out.dtype)
    return out


def fake_module() -> types.ModuleType:
    mod = types.ModuleType("flashinfer")
    mod.__version__ = VERSION
    mod.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    mod.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    return mod
