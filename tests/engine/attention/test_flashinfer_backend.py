from __future__ import annotations

import dataclasses
import inspect
import random

import pytest
import torch
from flashinfer_fakes import RECORDED, fake_module

from hotswap.engine.attention import flashinfer_backend, get_backend_class
from hotswap.engine.attention.flashinfer_backend import (
    FlashInferAttnBackend,
    build_paged_kv_indices,
    paged_view,
)
from hotswap.engine.attention.torch_backend import TorchAttnBackend
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.kvcache.memory import KVPool, ReqToTokenPool, TokenToKVPoolAllocator

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 9, 3, 64, 2

# (prefix_lens, extend_lens): seq lengths hit page boundaries (16, 32) and a one-token sequence.
CASES = {
    "decode": ([5, 17, 0, 32, 15], [1, 1, 1, 1, 1]),
    "extend_with_prefix": ([0, 7, 16], [9, 4, 20]),
    "mixed": ([3, 0, 20, 8], [1, 6, 1, 13]),
}


@dataclasses.dataclass
class Step:
    pool: KVPool
    req_to_token: torch.Tensor
    fb: ForwardBatch


def make_step(prefix_lens: list[int], extend_lens: list[int], page_size: int,
              device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
              num_kv_heads: int = NUM_KV_HEADS) -> Step:
    """A pool whose rows hold random prefix KV on scrambled pages, and the batch extending them."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    num_pages = sum(-(-s // page_size) for s in seq_lens) + 8
    alloc = TokenToKVPoolAllocator(num_pages, page_size)
    random.Random(seed).shuffle(alloc.free_pages)
    req_pool = ReqToTokenPool(len(seq_lens) + 2, max(seq_lens) + page_size, device)
    req_pool.alloc()
    rows = [req_pool.alloc() for _ in seq_lens][::-1]
    pool = KVPool(num_pages, page_size, NUM_LAYERS, num_kv_heads, HEAD_DIM, dtype, device)

    batch = len(seq_lens)
    prefix_slots = alloc.alloc_extend([0] * batch, [-1] * batch, prefix_lens)
    for row, slots in zip(rows, prefix_slots.split(prefix_lens), strict=True):
        req_pool.write(row, 0, slots)
    for k_buf, v_buf in zip(pool.k_buffers, pool.v_buffers, strict=True):
        shape = (prefix_slots.numel(), num_kv_heads, HEAD_DIM)
        k_buf[prefix_slots.to(device)] = torch.randn(shape, generator=gen).to(device, dtype)
        v_buf[prefix_slots.to(device)] = torch.randn(shape, generator=gen).to(device, dtype)

    last_locs = [int(req_pool.req_to_token[r, p - 1]) if p else -1
                 for r, p in zip(rows, prefix_lens, strict=True)]
    new_slots = alloc.alloc_extend(prefix_lens, last_locs, extend_lens)
    for row, start, slots in zip(rows, prefix_lens, new_slots.split(extend_lens),
                                     strict=True):
        req_pool.write(row, start, slots)
    for k_buf, v_buf in zip(pool.k_buffers, pool.v_buffers, strict=True):
        # stale values where this step's K/V go: a backend that reads before storing shows
        k_buf[new_slots.to(device)] = 7.0
        v_buf[new_slots.to(device)] = -7.0
    fb = ForwardBatch.build([0] * sum(extend_lens), new_slots, rows, prefix_lens, extend_lens,
                            device=device)
    return Step(pool, req_pool.req_to_token, fb)


def hand_built_table(page_size: int) -> tuple[torch.Tensor, list[list[int]]]:
    """req_to_token rows 0..2 and, for page_size 4, the pages each row's tokens sit on."""
    if page_size == 1:
        slots = {2: [9, 3, 14, 1, 7, 20, 11, 5], 0: [2, 4, 6, 8, 10, 12, 13],
                 1: [15, 16, 17, 18, 19]}
        pages = [slots[2], slots[0], slots[1]]
    else:
        pages = [[3, 7], [5, 2], [1, 6]]
        slots = {}
        for row, row_pages, seq in zip([2, 0, 1], pages, [8, 7, 5], strict=True):
            flat = [p * page_size + o for p in row_pages for o in range(page_size)]
            slots[row] = flat[:seq]
    table = torch.zeros(3, 12, dtype=torch.int64)
    for row, row_slots in slots.items():
        table[row, : len(row_slots)] = torch.tensor(row_slots)
    return table, pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_indices_of_a_mixed_batch_match_hand_computed(page_size):
    # Rows (in batch order) are table rows 2, 0, 1: an extend row with a 5-token prefix, a decode
    # row with a 6-token prefix and a fresh 5-token prompt.
    table, pages = hand_built_table(page_size)
    idx = build_paged_kv_indices(table, torch.tensor([2, 0, 1]), seq_lens=[8, 7, 5],
                                 extend_lens=[3, 1, 5], page_size=page_size)
    assert idx.qo_indptr.tolist() == [0, 3, 4, 9]
    if page_size == 1:
        assert idx.kv_indptr.tolist() == [0, 8, 15, 20]
        assert idx.kv_last_page_len.tolist() == [1, 1, 1]
    else:
        assert idx.kv_indptr.tolist() == [0, 2, 4, 6]
        assert idx.kv_last_page_len.tolist() == [4, 3, 1]
    assert idx.kv_indices.tolist() == [p for row_pages in pages for p in row_pages]
    for t in idx:
        assert t.dtype == torch.int32


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_view_reads_exactly_each_rows_tokens(case, page_size):
    # Walk the page table the way the kernels do and compare with the row's slots in the pool.
    prefix_lens, extend_lens = CASES[case]
    step = make_step(prefix_lens, extend_lens, page_size)
    fb = step.fb
    idx = build_paged_kv_indices(step.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu,
                                 fb.extend_seq_lens_cpu, page_size)
    k_buf = step.pool.k_buffers[1]
    k_buf.normal_()  # the pool is allocated uninitialised: NaN garbage would fail torch.equal
    view = paged_view(k_buf, page_size)
    for i, row in enumerate(fb.req_pool_indices.tolist()):
        row_pages = idx.kv_indices[idx.kv_indptr[i]: idx.kv_indptr[i + 1]].long()
        seen = view[row_pages].flatten(0, 1)
        num_tokens = (row_pages.numel() - 1) * page_size + int(idx.kv_last_page_len[i])
        assert num_tokens == fb.seq_lens_cpu[i]
        want = k_buf[step.req_to_token[row, :num_tokens]]
        assert torch.equal(seen[:num_tokens], want)
    assert idx.qo_indptr.diff().tolist() == fb.extend_seq_lens_cpu


def test_registry_imports_without_flashinfer():
    assert get_backend_class("flashinfer") is FlashInferAttnBackend


def test_constructing_without_cuda_says_what_to_use():
    step = make_step([0], [3], page_size=1, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="use attention_backend='torch'"):
        FlashInferAttnBackend(step.pool, step.req_to_token, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                              HEAD_DIM**-0.5)


def float32_copy(pool: KVPool) -> KVPool:
    ref = KVPool(pool.num_pages, pool.page_size, pool.num_layers, pool.num_kv_heads,
                 pool.head_dim, torch.float32, pool.device)
    for dst, src in zip(ref.k_buffers + ref.v_buffers, pool.k_buffers + pool.v_buffers,
                        strict=True):
        dst.copy_(src)
    return ref


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 1e-2)],
                         ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_backend(case, page_size, dtype, tol):
    pytest.importorskip("flashinfer")
    prefix_lens, extend_lens = CASES[case]
    step = make_step(prefix_lens, extend_lens, page_size, device="cuda", dtype=dtype)
    ref_pool = float32_copy(step.pool)
    scaling = HEAD_DIM**-0.5
    backend = FlashInferAttnBackend(step.pool, step.req_to_token, NUM_HEADS, NUM_KV_HEADS,
                                    HEAD_DIM, scaling)
    reference = TorchAttnBackend(ref_pool, step.req_to_token, NUM_HEADS, NUM_KV_HEADS,
                                 HEAD_DIM, scaling)
    fb, ref_fb = step.fb, dataclasses.replace(step.fb)
    backend.init_forward_metadata(fb)
    reference.init_forward_metadata(ref_fb)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for layer in range(NUM_LAYERS):
        q, k, v = (torch.randn(fb.num_tokens, h * HEAD_DIM, device="cuda", generator=gen)
                   .to(dtype) for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
        out = backend.forward(q, k, v, layer, fb)
        want = reference.forward(q.float(), k.float(), v.float(), layer, ref_fb)
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


# Not head_dim ** -0.5, flashinfer's default when sm_scale is None: a dropped scale shows.
SCALING = 0.1
HEADS = [pytest.param((9, 3), id="group3"), pytest.param((16, 2), id="group8-tensor-cores")]


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend on CPU, driving fakes bound to flashinfer's real signatures."""
    monkeypatch.setattr(flashinfer_backend, "_cuda_ready", lambda device: True)
    monkeypatch.setattr(flashinfer_backend, "_import_flashinfer", fake_module)
    monkeypatch.setattr(flashinfer_backend, "WORKSPACE_BYTES", 1024)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_through_checked_fakes(fake_flashinfer, case, page_size, heads):
    num_heads, num_kv_heads = heads
    prefix_lens, extend_lens = CASES[case]
    step = make_step(prefix_lens, extend_lens, page_size, dtype=torch.bfloat16,
                     num_kv_heads=num_kv_heads)
    ref_pool = float32_copy(step.pool)
    backend = FlashInferAttnBackend(step.pool, step.req_to_token, num_heads, num_kv_heads,
                                    HEAD_DIM, SCALING)
    assert backend.decode_wrapper.init_args["use_tensor_cores"] == (num_heads // num_kv_heads > 4)
    reference = TorchAttnBackend(ref_pool, step.req_to_token, num_heads, num_kv_heads,
                                 HEAD_DIM, SCALING)
    fb, ref_fb = step.fb, dataclasses.replace(step.fb)
    backend.init_forward_metadata(fb)
    reference.init_forward_metadata(ref_fb)
    wrapper = fb.attn_metadata
    assert wrapper is (backend.decode_wrapper if case == "decode" else backend.prefill_wrapper)
    gen = torch.Generator().manual_seed(1)
    for layer in range(NUM_LAYERS):
        q, k, v = (torch.randn(fb.num_tokens, h * HEAD_DIM, generator=gen).to(torch.bfloat16)
                   for h in (num_heads, num_kv_heads, num_kv_heads))
        out = backend.forward(q, k, v, layer, fb)
        want = reference.forward(q.float(), k.float(), v.float(), layer, ref_fb)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    assert wrapper.plans == 1  # planned once per step, every layer reuses it


def test_fakes_refuse_a_call_the_real_signature_refuses(fake_flashinfer):
    wrapper = fake_module().BatchPrefillWithPagedKVCacheWrapper(torch.zeros(8), "NHD")
    with pytest.raises(TypeError):
        wrapper.plan(torch.zeros(2, dtype=torch.int32), causal=True, scale=0.1)


def _parameters(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("cls_name", sorted(RECORDED))
def test_recorded_signatures_match_the_installed_flashinfer(cls_name):
    flashinfer = pytest.importorskip("flashinfer")
    real, recorded = getattr(flashinfer, cls_name), RECORDED[cls_name]
    for method in ("__init__", "plan", "_plan_impl", "run"):
        if hasattr(recorded, method):
            assert _parameters(getattr(real, method)) == _parameters(getattr(recorded, method)), (
                f"flashinfer {flashinfer.__version__} {cls_name}.{method} changed; "
                "update tests/engine/attention/flashinfer_fakes.py")
