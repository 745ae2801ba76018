"""The triton backend's attention equals the torch reference backend's: decode, extend, mixed."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch

# Without CUDA the kernels run under Triton's interpreter: conftest.py sets TRITON_INTERPRET.
from hotswap.engine.attention.torch_backend import TorchAttnBackend
from hotswap.engine.attention.triton_backend import TritonAttnBackend
from hotswap.engine.attention.triton_launch import SHARED_MEMORY_PER_BLOCK, gpu_launch_config
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.kvcache.memory import KVPool, ReqToTokenPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_LAYERS = 2
LAYER = 1  # not 0, so a kernel that ignores the layer's buffers is caught


@dataclass
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 1
    dtype: torch.dtype = torch.float32


@dataclass
class Case:
    pool: KVPool
    req_to_token: torch.Tensor
    fb: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def row_slots(seq_lens: list[int], page_size: int, rng: random.Random) -> list[list[int]]:
    """Scattered slots per row: pages in shuffled order, tokens contiguous within a page."""
    pages_per_row = [-(-n // page_size) for n in seq_lens]
    pages = list(range(1, sum(pages_per_row) + 1))  # page 0 is the reserved zero page
    rng.shuffle(pages)
    slots, used = [], 0
    for n_pages, n in zip(pages_per_row, seq_lens, strict=True):
        mine = pages[used: used + n_pages]
        used += n_pages
        slots.append([pg * page_size + off for pg in mine for off in range(page_size)][:n])
    return slots


def make_case(shape: Shape, prefix_lens: list[int], extend_lens: list[int], seed: int = 0,
              device: str = DEVICE, qkv_fused: bool = False) -> Case:
    """A pool with random K/V in every row's prefix slots and random q/k/v for the new tokens."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    slots = row_slots(seq_lens, shape.page_size, rng)
    num_pages = sum(-(-n // shape.page_size) for n in seq_lens)
    kv_shape = (shape.num_kv_heads, shape.head_dim)
    pool = KVPool(num_pages, shape.page_size, NUM_LAYERS, *kv_shape, shape.dtype, device)
    for layer in range(NUM_LAYERS):
        used = torch.tensor([s for row in slots for s in row])
        for buf in (pool.k_buffers[layer], pool.v_buffers[layer]):
            buf[used.to(device)] = torch.randn(used.numel(), *kv_shape, generator=gen).to(buf)
    max_len = max(len(row) for row in slots)
    table = ReqToTokenPool(len(slots) + 3, max_len + 5, device)
    req_rows = list(range(len(slots) + 2, 2, -1))[: len(slots)]  # not 0..B-1, not in order
    for req, row in zip(req_rows, slots, strict=True):
        table.write(req, 0, torch.tensor(row))
    new = [row[p:] for row, p in zip(slots, prefix_lens, strict=True)]
    new_slots = torch.tensor([s for row in new for s in row])
    # the new tokens' slots hold stale values until the backend stores k/v there
    pool.k_buffers[LAYER][new_slots.to(device)] = 7.0
    pool.v_buffers[LAYER][new_slots.to(device)] = -7.0
    t = int(new_slots.numel())
    fb = ForwardBatch.build([0] * t, new_slots, req_rows, prefix_lens, extend_lens, device=device)
    hq, hkv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    qkv = torch.randn(t, hq + 2 * hkv, generator=gen).to(device=device, dtype=shape.dtype)
    q, k, v = qkv.split([hq, hkv, hkv], dim=-1)
    if not qkv_fused:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return Case(pool, table.req_to_token, fb, q, k, v)


def run_backend(cls: type, case: Case, shape: Shape, scaling: float | None = None
                ) -> torch.Tensor:
    backend = cls(case.pool, case.req_to_token, shape.num_heads, shape.num_kv_heads,
                  shape.head_dim, shape.head_dim ** -0.5 if scaling is None else scaling)
    return run(backend, case)


def run(backend, case: Case) -> torch.Tensor:
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    return backend.forward(case.q, case.k, case.v.contiguous(), LAYER, case.fb)


def max_diff(case: Case, shape: Shape, backend: TritonAttnBackend | None = None) -> float:
    """Triton output vs torch output on the same pool; triton runs first and stores the new K/V."""
    got = run_backend(TritonAttnBackend, case, shape) if backend is None else run(backend, case)
    loc = case.fb.out_cache_loc
    stored = case.pool.k_buffers[LAYER][loc].reshape(case.k.shape)
    assert torch.equal(stored, case.k)
    want = run_backend(TorchAttnBackend, case, shape)
    assert got.shape == want.shape and got.dtype == want.dtype
    return (got.float() - want.float()).abs().max().item()


def fp32_reference(case: Case, shape: Shape, scaling: float | None = None) -> torch.Tensor:
    """The torch backend in fp32 on the same (already rounded) pool contents and q/k/v."""
    src = case.pool
    pool = KVPool(src.num_pages, src.page_size, NUM_LAYERS, src.num_kv_heads, src.head_dim,
                  torch.float32, src.device)
    for dst, buf in zip(pool.k_buffers + pool.v_buffers, src.k_buffers + src.v_buffers,
                        strict=True):
        dst.copy_(buf.float())
    ref = Case(pool, case.req_to_token, case.fb, case.q.float(), case.k.float(), case.v.float())
    return run_backend(TorchAttnBackend, ref, shape, scaling)


GQA_SHAPES = [
    pytest.param(Shape(4, 2, 16), id="gqa2-d16-page1"),
    pytest.param(Shape(4, 1, 32, page_size=4), id="gqa4-d32-page4"),
    pytest.param(Shape(2, 2, 16, page_size=4), id="mha-d16-page4"),
    pytest.param(Shape(8, 1, 16), id="gqa8-d16-page1"),
    pytest.param(Shape(12, 2, 16, page_size=4), id="gqa6-d16-page4"),
]


@pytest.mark.parametrize("shape", GQA_SHAPES)
@pytest.mark.parametrize("split_tokens", [256, 4], ids=["one-split", "split-k"])
def test_decode_rows_of_different_lengths(shape: Shape, split_tokens: int):
    prefix = [0, 4, 19, 33, 7]
    case = make_case(shape, prefix, [1] * len(prefix))
    backend = TritonAttnBackend(case.pool, case.req_to_token, shape.num_heads, shape.num_kv_heads,
                                shape.head_dim, shape.head_dim ** -0.5)
    backend.min_split_tokens = split_tokens
    backend.init_forward_metadata(case.fb)
    # the longest row has 34 keys: one split of 256, or nine of at most 4
    assert case.fb.attn_metadata.decode.num_splits == (1 if split_tokens == 256 else 9)
    assert max_diff(case, shape, backend) <= 1e-4


@pytest.mark.parametrize("shape", GQA_SHAPES)
def test_row_reading_slots_another_row_writes_in_the_same_step(shape: Shape):
    """Requests admitted together share a prefix's pages (KVManager.admit): row 1's prefix is
    row 0's first two pages, whose K/V row 0 stores in this very step. A stale 7.0 there (see
    make_case) would show if the kernel read before the store."""
    ps = shape.page_size
    case = make_case(shape, [0, 2 * ps, 5], [5 * ps, 3, 1])
    row1 = case.fb.req_pool_indices[1]
    case.req_to_token[row1, : 2 * ps] = case.fb.out_cache_loc[: 2 * ps]
    assert max_diff(case, shape) <= 1e-4


@pytest.mark.parametrize("shape", GQA_SHAPES)
def test_extend_prompt_split_at_several_points(shape: Shape):
    # one 37-token prompt per row, its prefix cached up to a different point in each row; with
    # the interpreter's 16-token tiles the 0-prefix row spans three query tiles
    prefix = [0, 3, 11, 16, 30]
    case = make_case(shape, prefix, [37 - p for p in prefix])
    assert max_diff(case, shape) <= 1e-4


@pytest.mark.parametrize("shape", GQA_SHAPES)
def test_mixed_decode_and_extend_rows(shape: Shape):
    prefix = [12, 0, 5, 20, 1, 9]
    extend = [1, 6, 1, 18, 2, 1]
    case = make_case(shape, prefix, extend)
    assert max_diff(case, shape) <= 1e-4


def test_strided_q_from_fused_qkv():
    shape = Shape(4, 2, 16)
    case = make_case(shape, [3, 0, 8], [1, 5, 2], qkv_fused=True)
    assert not case.q.is_contiguous()
    assert max_diff(case, shape) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pools(dtype: torch.dtype):
    shape = Shape(4, 2, 16, page_size=4, dtype=dtype)
    case = make_case(shape, [0, 7, 13], [9, 1, 4], seed=1)
    got = run_backend(TritonAttnBackend, case, shape)
    assert got.dtype == dtype
    # half an ulp of output rounding is up to 1.6e-2 at |out| in [4, 8); GPU dots also round p
    assert (got.float() - fp32_reference(case, shape)).abs().max().item() <= 3e-2


def test_strided_q_decode_rows_away_from_token_0():
    """Decode rows at flat tokens 7 and 8 of a fused qkv: a kernel reading q at
    row * num_heads * head_dim instead of row * q.stride(0) reads k and v there."""
    shape = Shape(4, 2, 16)
    case = make_case(shape, [3, 0, 8, 5], [2, 5, 1, 1], qkv_fused=True)
    assert case.q.stride(0) != shape.num_heads * shape.head_dim
    assert max_diff(case, shape) <= 1e-4


@pytest.mark.parametrize("shape", GQA_SHAPES[:2])
def test_a_softmax_scale_other_than_the_default(shape: Shape):
    """Qwen-style query_pre_attn_scalar models pass a scale that is not head_dim ** -0.5."""
    case = make_case(shape, [12, 0, 5, 30], [1, 6, 1, 18])
    got = run_backend(TritonAttnBackend, case, shape, scaling=0.3)
    want = run_backend(TorchAttnBackend, case, shape, scaling=0.3)
    assert (got - want).abs().max().item() <= 1e-4


GPU_SMS = 132  # an H100's SMs: what target_programs would be on one


@pytest.mark.parametrize("rows,max_len,want", [
    (1, 100, 1),  # one short row: no split
    (1, 5000, 16),  # one long row: capped at max_kv_splits
    (4, 1000, 4),  # by length: 1,000 keys in splits of 256
    (64, 3000, 3),  # by occupancy: 64 rows x 3 kv heads already fill 4 x 132 programs
    (256, 3000, 1),  # a full batch: no split at all
])
def test_split_heuristic_on_a_gpu_sized_target(rows: int, max_len: int, want: int):
    shape = Shape(9, 3, 16)
    case = make_case(shape, [0], [1])
    backend = TritonAttnBackend(case.pool, case.req_to_token, 9, 3, 16, 0.25)
    backend.target_programs = 4 * GPU_SMS
    assert backend._num_splits(rows, max_len) == want


def gpu_sized_backend(case: Case, shape: Shape) -> TritonAttnBackend:
    """The backend as it runs on an sm_89 GPU: its tile sizes and split target."""
    backend = TritonAttnBackend(case.pool, case.req_to_token, shape.num_heads,
                                shape.num_kv_heads, shape.head_dim, shape.head_dim ** -0.5)
    if case.pool.device.type != "cuda":
        backend.cfg = gpu_launch_config(shape.dtype, shape.head_dim, backend.group,
                                        SHARED_MEMORY_PER_BLOCK[89])
        backend.target_programs = 4 * GPU_SMS
    return backend


# HOTSWAP_TRITON_GPU_SIZES=1: both page sizes and the full lengths (minutes under the interpreter).
FULL_GPU_SIZES = os.environ.get("HOTSWAP_TRITON_GPU_SIZES") == "1" or torch.cuda.is_available()


def realistic_batches(full: bool) -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(0)
    if full:
        return {
            "decode": ([rng.randrange(1, 3000) for _ in range(48)], [1] * 48),
            "extend": ([0, 100, 517, 1000, 2047], [700, 64, 300, 2, 129]),
            "mixed": ([rng.randrange(0, 2000) for _ in range(24)],
                      [rng.choice([1, 1, 1, 37, 200]) for _ in range(24)]),
        }
    # still several 64-token tiles, several 32-key steps and a multi-split decode row
    return {"mixed": ([1200, 0, 70, 300, 5, 640], [1, 150, 1, 66, 1, 2])}


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [
    16, pytest.param(1, marks=pytest.mark.skipif(not FULL_GPU_SIZES,
                                                   reason="HOTSWAP_TRITON_GPU_SIZES=1"))])
def test_realistic_shapes_bf16_gpu_tiles(page_size: int):
    """SmolLM2-like heads (9 q / 3 kv, head_dim 64) in bf16 with the GPU's tiles, against the fp32
    torch reference; on CPU under the interpreter, which checks the tiling, not the casts."""
    shape = Shape(9, 3, 64, page_size=page_size, dtype=torch.bfloat16)
    for name, (prefix, extend) in realistic_batches(FULL_GPU_SIZES).items():
        case = make_case(shape, prefix, extend)
        backend = gpu_sized_backend(case, shape)
        got = run(backend, case).float()
        if case.fb.attn_metadata.decode is not None and case.pool.device.type != "cuda":
            assert case.fb.attn_metadata.decode.num_splits > 1
        err = (got - fp32_reference(case, shape)).abs()
        # bf16 rounding of the output and of p bounds single errors; a real bug moves the mean
        assert err.max().item() <= 5e-2, f"{name}: max abs diff {err.max().item()}"
        assert err.mean().item() <= 4e-3, f"{name}: mean abs diff {err.mean().item()}"
