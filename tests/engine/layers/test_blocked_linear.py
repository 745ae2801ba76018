"""cpu_kernels.blocked_linear, the batch-invariant matmul (every matmul off AMX): every row's
bits are the same whatever the rows beside it, their order and count; the sums are x @ w.T
(+ bias) (+ residual) to float32 rounding; padded outputs, bad shapes, the bf16 layout widened."""

from __future__ import annotations

import mmap

import pytest
import torch

from hotswap.engine.layers import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs the CPU kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(96, 64), (70, 128), (8, 40)])  # 70, 8: padded to 32s
def test_rows_never_depend_on_their_batch(dtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(75, k, generator=g).to(dtype)
    res = torch.randn(75, n, generator=g).to(dtype)
    blocked = cpu_kernels.block_pack(w)
    full = cpu_kernels.blocked_linear(x, blocked, bias, res, outputs=n)
    assert full.shape == (75, n) and full.dtype == dtype
    for rows in ([0], [74], list(range(13)), [5, 3, 60, 2]):
        idx = torch.tensor(rows)
        part = cpu_kernels.blocked_linear(x[idx], blocked, bias, res[idx], outputs=n)
        assert torch.equal(part, full[idx])
    perm = torch.randperm(75, generator=g)
    assert torch.equal(cpu_kernels.blocked_linear(x[perm], blocked, bias, res[perm], outputs=n),
                       full[perm])
    want = x.double() @ w.double().T + bias.double() + res.double()
    sums = cpu_kernels.blocked_linear(x, blocked, bias, res, float_out=True, outputs=n)
    assert sums.dtype == torch.float32
    assert torch.allclose(sums.double(), want, rtol=0, atol=1e-4 * k ** 0.5)
    assert torch.equal(full, sums.to(dtype))  # one rounding of the float32 sum


def test_bad_shapes_are_refused():
    w = cpu_kernels.block_pack(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="blocked layout"):
        cpu_kernels.blocked_linear(torch.randn(3, 16), w)
    with pytest.raises(RuntimeError, match="outputs"):
        cpu_kernels.blocked_linear(torch.randn(3, 32), w, outputs=20)
    with pytest.raises(RuntimeError, match="residual"):
        cpu_kernels.blocked_linear(torch.randn(3, 32), w, residual=torch.randn(2, 64))


@pytest.mark.parametrize("n", [96, 70])  # 70: padded to 32s
def test_widened_bf16_layout_is_the_float32_one(n):
    """widen_blocked (the float32 head of a bf16 model, built from its bf16 copy) gives exactly
    the float32 layout of the widened weight."""
    w = torch.randn(n, 48).bfloat16()
    assert torch.equal(cpu_kernels.widen_blocked(cpu_kernels.block_pack(w)),
                       cpu_kernels.block_pack(w.float()))


def test_packed_side_by_side_in_huge_pages_equal_each_pack():
    """block_pack_all (a model's blocked copies, in one region per dtype) gives each weight's
    block_pack, in memory that asks for 2 MiB pages from its first boundary on."""
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, k, generator=g).to(dtype) for n, k, dtype in
               [(1024, 576, torch.bfloat16), (70, 64, torch.float32), (3072, 576, torch.bfloat16),
                (576, 1536, torch.bfloat16)]]
    packs = cpu_kernels.block_pack_all(weights)
    for w, packed in zip(weights, packs):
        assert torch.equal(packed, cpu_kernels.block_pack(w))
    # the bf16 copies lie side by side in the order given, in one region of huge pages
    assert packs[2].data_ptr() == packs[0].data_ptr() + packs[0].nbytes
    assert packs[3].data_ptr() == packs[2].data_ptr() + packs[2].nbytes
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert packs[0].data_ptr() % cpu_kernels.HUGE_PAGE == 0


def test_huge_empty_is_an_ordinary_tensor():
    small = cpu_kernels.huge_empty((3, 4), torch.float32)  # under a huge page: torch.empty
    big = cpu_kernels.huge_empty((2, 1 << 20), torch.bfloat16)
    assert small.shape == (3, 4) and big.shape == (2, 1 << 20) and big.dtype == torch.bfloat16
    big.fill_(2.0)
    assert big.is_contiguous() and float(big.float().sum()) == 4 << 20
    # the tensor is its storage's whole (a flat parameter buffer is laid out by storage offsets)
    assert big.untyped_storage().nbytes() == big.nbytes and big.storage_offset() == 0
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert big.data_ptr() % cpu_kernels.HUGE_PAGE == 0
    view = big[1]
    del big  # a view keeps the region mapped
    assert float(view[-1]) == 2.0
