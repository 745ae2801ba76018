"""The fused CPU kernels (engine/layers/csrc/) against torch-ops references, and a model stepped
through them against the same model stepped op by op."""

from __future__ import annotations

import math
import mmap
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fixtures import Seq, run_step

from hotswap.engine.attention import torch_backend
from hotswap.engine.attention.torch_backend import AMX_EXTEND_MAX_KEYS
from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.executor import sampling
from hotswap.engine.executor.model_runner import ModelRunner
from hotswap.engine.layers import cpu_kernels, kernel_build
from hotswap.engine.layers.norm import rms_norm

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def kernels():
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja here: the engine runs torch ops instead")
    if os.environ.get("HOTSWAP_CPU_KERNELS") == "0":
        pytest.skip("CPU kernels turned off (HOTSWAP_CPU_KERNELS=0)")
    assert cpu_kernels.available(), "a compiler is here but the kernels did not build (see log)"


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """got (rounded once to dtype) against a float64 reference."""
    rel = 1e-5 if dtype == torch.float32 else 2 ** -8
    err = (got.double() - want).abs()
    assert (err <= rel * want.abs() + rel).all(), float(err.max())


def reference_attention(q, k_buf, v_buf, table, req_idx, seq_lens, scale):
    n, hkv, d = q.shape[0], k_buf.shape[1], k_buf.shape[2]
    out = []
    for i in range(n):
        slots = table[req_idx[i], : seq_lens[i]]
        k = k_buf[slots].double().transpose(0, 1)  # [Hkv, L, D]
        v = v_buf[slots].double().transpose(0, 1)
        qi = q[i].double().view(hkv, -1, d)  # [Hkv, group, D]
        p = torch.softmax(qi @ k.transpose(1, 2) * scale, -1)
        out.append((p @ v).reshape(-1))
    return torch.stack(out)


def slot_table(rows: int, width: int, slots: int, layout: str, g: torch.Generator
               ) -> torch.Tensor:
    """Each row's KV slots: scattered (a decode's, its batch-mates' steps between them) or in
    runs of 8 to 200 consecutive slots (prompts'; on AMX a row of mostly whole runs of 16 keys
    has them read where they lie, the rest copied)."""
    if layout == "scattered":
        return torch.stack([torch.randperm(slots - 1, generator=g)[:width] + 1
                            for _ in range(rows)])
    table = []
    for _ in range(rows):
        runs, n = [], 0
        while n < width:
            run = int(torch.randint(8, 201, (1,), generator=g))
            start = int(torch.randint(1, slots - run, (1,), generator=g))
            runs.append(torch.arange(start, start + run))
            n += run
        table.append(torch.cat(runs)[:width])
    return torch.stack(table)


@pytest.mark.parametrize("layout", ["scattered", "runs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 7), (64, 16), (16, 1), (48, 2)])
def test_decode_attention_matches_reference(dtype, head_dim, group, layout):
    g = torch.Generator().manual_seed(head_dim + group)
    hkv, slots, width = 2, 4000, 700
    k_buf = torch.randn(slots, hkv, head_dim, generator=g).to(dtype)
    v_buf = torch.randn(slots, hkv, head_dim, generator=g).to(dtype)
    # Few rows run a task per (row, kv head), many (>= 4 per thread) a task per row.
    rows = 4 * torch.get_num_threads() + 1
    table = slot_table(rows, width, slots, layout, g)
    req_idx = torch.randperm(rows, generator=g)
    # one key, block edges, the full row
    seq_lens = torch.tensor([1, 31, 33, 700, 129] + [3 * i + 1 for i in range(rows - 5)])
    q = torch.randn(rows, hkv * group * head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    for n in (5, rows):
        args = (q[:n], k_buf, v_buf, table, req_idx[:n], seq_lens[:n], scale)
        got = cpu_kernels.decode_attention(*args)
        assert got.dtype == dtype and got.shape == q[:n].shape
        close(got, reference_attention(*args), dtype)


def test_decode_attention_rows_do_not_depend_on_batch_mates():
    g = torch.Generator().manual_seed(1)
    k_buf, v_buf = torch.randn(2, 500, 3, 64, generator=g).bfloat16()
    table = torch.randint(1, 500, (8, 200), generator=g)
    q = torch.randn(8, 9 * 64, generator=g).bfloat16()
    lens = torch.randint(1, 200, (8,), generator=g)
    batch = cpu_kernels.decode_attention(q, k_buf, v_buf, table, torch.arange(8), lens, 0.125)
    for i in range(8):
        alone = cpu_kernels.decode_attention(q[i: i + 1], k_buf, v_buf, table,
                                             torch.tensor([i]), lens[i: i + 1], 0.125)
        assert torch.equal(alone[0], batch[i])


@pytest.mark.parametrize("layout", ["scattered", "runs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_decode_attention_joins_the_chunks_of_long_rows(dtype, layout):
    """Rows longer than a chunk (1,024 keys) are attended a chunk per task and joined by their
    softmax sums: the same output as one softmax over all keys, for one row alone (chunk and
    kv head tasks) and beside short ones, and a row's bits never depend on its batch-mates."""
    g = torch.Generator().manual_seed(4)
    slots, width = 6000, 2600
    k_buf, v_buf = torch.randn(2, slots, 3, 64, generator=g).to(dtype)
    table = slot_table(5, width, slots, layout, g)
    q = torch.randn(5, 9 * 64, generator=g).to(dtype)
    lens = torch.tensor([2600, 1024, 1025, 7, 2049])
    batch = cpu_kernels.decode_attention(q, k_buf, v_buf, table, torch.arange(5), lens, 0.125)
    close(batch, reference_attention(q, k_buf, v_buf, table, torch.arange(5), lens, 0.125), dtype)
    for i in range(5):
        alone = cpu_kernels.decode_attention(q[i: i + 1], k_buf, v_buf, table,
                                             torch.tensor([i]), lens[i: i + 1], 0.125)
        assert torch.equal(alone[0], batch[i])


def test_decode_attention_reads_strided_queries():
    """q as the model passes it: a column slice of the fused qkv output."""
    g = torch.Generator().manual_seed(2)
    k_buf, v_buf = torch.randn(2, 100, 1, 64, generator=g)
    qkv = torch.randn(3, 3 * 64, generator=g)
    table, lens = torch.randint(1, 100, (3, 40), generator=g), torch.tensor([40, 7, 1])
    args = (k_buf, v_buf, table, torch.arange(3), lens, 0.125)
    assert torch.equal(cpu_kernels.decode_attention(qkv[:, :64], *args),
                       cpu_kernels.decode_attention(qkv[:, :64].contiguous(), *args))


def test_bad_inputs_are_refused_with_a_clear_error():
    k_buf = v_buf = torch.zeros(10, 1, 64)
    table, q = torch.zeros(1, 5, dtype=torch.int64), torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match="seq_len out of range"):
        cpu_kernels.decode_attention(q, k_buf, v_buf, table, torch.tensor([0]),
                                     torch.tensor([6]), 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        cpu_kernels.silu_and_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernels.decode_attention(q.bfloat16(), k_buf, v_buf, table, torch.tensor([0]),
                                     torch.tensor([5]), 1.0)
    x, w, norm = torch.zeros(1, 64), torch.zeros(64, 64), torch.ones(64)
    layer = cpu_kernels.LayerWeights(norm, w, None, w, norm, w, w)
    stack = cpu_kernels.decode_stack([layer], 1e-5, 0, 1)
    assert len(stack) == 1
    with pytest.raises(RuntimeError, match="a K and a V buffer per layer"):  # two, one layer
        cpu_kernels.decode_layers(x, stack, [k_buf] * 2, [v_buf] * 2, torch.zeros(1, 32),
                                  torch.zeros(1, 32), torch.tensor([0]), table,
                                  torch.tensor([0]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="path must be"):
        cpu_kernels.decode_stack([layer], 1e-5, 7, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rotary_in_place_matches_reference(dtype):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(7, 12 * 64, generator=g).to(dtype)
    cos, sin = torch.rand(2, 7, 32, generator=g) * 2 - 1
    x = qkv[:, : 10 * 64].view(7, 10, 64)  # q and k heads of a fused qkv, v left alone
    x1, x2 = x.double().chunk(2, -1)
    c, s = cos.double()[:, None], sin.double()[:, None]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    v_before = qkv[:, 10 * 64:].clone()
    out = cpu_kernels.rotary_(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()
    close(x, want, dtype)
    assert torch.equal(qkv[:, 10 * 64:], v_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_silu_and_mul_matches_reference(dtype):
    x = (torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    gate, up = x.double().chunk(2, -1)
    close(cpu_kernels.silu_and_mul(x), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_silu_and_mul_vector_loop_equals_its_scalar_tail(dtype):
    # A row of 112 runs in vector lanes; rows of 7 (fewer than a vector's 8 or 16 lanes) run
    # the same values through the scalar loop: the bits must not depend on which.
    g = (torch.randn(112, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)
    u = torch.randn(112, generator=torch.Generator().manual_seed(2)).to(dtype)
    whole = cpu_kernels.silu_and_mul(torch.cat((g, u))[None])[0]
    tails = torch.cat([cpu_kernels.silu_and_mul(torch.cat((g[i:i + 7], u[i:i + 7]))[None])[0]
                       for i in range(0, 112, 7)])
    assert torch.equal(whole, tails)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rms_norm_matches_reference(dtype):
    """Rows of 2-D input and of the strided per-head slices Qwen3's q/k norms take."""
    g = torch.Generator().manual_seed(9)
    weight = (1 + 0.3 * torch.randn(64, generator=g)).to(dtype)
    qkv = (torch.randn(5, 12, 64, generator=g) * 3).to(dtype)
    for x in (qkv.view(30, 128), qkv[:, 2:9]):
        want = F.rms_norm(x.double(), (x.shape[-1],), None, 1e-6)
        want = want * (weight.double() if x.shape[-1] == 64 else 1)
        w = weight if x.shape[-1] == 64 else torch.ones(x.shape[-1], dtype=dtype)
        got = rms_norm(x, w, 1e-6)
        assert got.shape == x.shape
        close(got, want, dtype)
    with pytest.raises(RuntimeError, match="of one dtype"):
        cpu_kernels.rms_norm(qkv.view(30, 128).float(), torch.ones(128, dtype=torch.bfloat16),
                             1e-6)


def test_small_linear_is_the_float32_product_of_bf16_weights():
    """float32 x: float32 out. bf16 x with a bias and a residual: the float32 sum of all three
    rounded once. Weight rows not a multiple of the 4-row tile, more rows than the prefetch
    reaches ahead; each row as it is alone."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1001, 576, generator=g).bfloat16()
    x = torch.randn(2, 576, generator=g)
    close(cpu_kernels.small_linear(x, w), x.double() @ w.double().T, torch.float32)
    xb, bias, res = (t.bfloat16() for t in (x, torch.randn(1001, generator=g),
                                            torch.randn(2, 1001, generator=g)))
    got = cpu_kernels.small_linear(xb, w, bias, res)
    want = xb.double() @ w.double().T + bias.double() + res.double()
    assert got.dtype == torch.bfloat16
    close(got, want, torch.bfloat16)
    alone = cpu_kernels.small_linear(xb[1:], w, bias, res[1:])
    assert torch.equal(alone[0], got[1])
    many = torch.randn(11, 576, generator=g).bfloat16()  # past the 8 rows held in registers
    got = cpu_kernels.small_linear(many, w)
    close(got, many.double() @ w.double().T, torch.bfloat16)
    for i in (4, 5, 10):
        assert torch.equal(got[i], cpu_kernels.small_linear(many[i:i + 1], w)[0])
    with pytest.raises(RuntimeError, match="residual must be"):
        cpu_kernels.small_linear(xb, w, bias, res.float())


def test_sample_rows_draws_what_the_torch_ops_draw():
    """The fused whole-vocabulary draw against sampling.py's torch path: the same tokens at the
    same uniforms (including u at the ends of [0, 1)), the same log-sum-exp, on vocabularies
    that end inside a block; greedy rows take the first maximum."""
    g = torch.Generator().manual_seed(8)
    for vocab in (49152, 1003, 5):
        x = torch.randn(257, vocab, generator=g) * 3
        u = torch.rand(257, generator=g, dtype=torch.float64)
        u[:2] = torch.tensor([0.0, 1.0 - 2 ** -53], dtype=torch.float64)
        tokens, lse = cpu_kernels.sample_rows(x, u)
        assert torch.equal(tokens, sampling._inverse_cdf(torch.softmax(x, -1), u))
        # float32 block sums cumulated in float64: closer to float64 than softmax's normaliser
        torch.testing.assert_close(lse, torch.logsumexp(x.double(), -1), atol=1e-6, rtol=0)
        x[:, 1] = x.amax(-1)  # a tie with the first maximum past index 1 where it was later
        assert torch.equal(cpu_kernels.sample_rows(x, None)[0], sampling._argmax(x))


def test_sample_rows_never_draws_a_masked_token_and_survives_empty_rows():
    x = torch.full((4, 3000), -math.inf)
    x[:3, [7, 2999]] = torch.tensor([0.0, -30.0])
    u = torch.tensor([0.0, 0.5, 1.0 - 2 ** -53, 0.5], dtype=torch.float64)
    tokens, lse = cpu_kernels.sample_rows(x, u)
    assert tokens[:3].tolist() == [7, 7, 2999]  # u near 1 lands on the 1e-13 token
    assert 0 <= int(tokens[3]) < 3000 and torch.isneginf(lse[3])  # no finite logit: no crash
    bad = torch.randn(2, 1003)
    bad[0, 500] = math.nan  # a NaN logit makes its row's log-sum-exp NaN, never a finite lie
    tokens, lse = cpu_kernels.sample_rows(bad, u[:2])
    assert torch.isnan(lse[0]) and torch.isfinite(lse[1]) and 0 <= int(tokens[0]) < 1003
    with pytest.raises(RuntimeError, match="one uniform per row"):
        cpu_kernels.sample_rows(x, u[:2])


amx_only = pytest.mark.skipif(not cpu_kernels.amx(),
                              reason="no AMX here (or a compiler without its intrinsics)")


@amx_only
@pytest.mark.parametrize("vocab,k", [(1000, 576), (333, 96), (70, 41)])
def test_amx_head_is_the_float32_final_norm_and_lm_head(vocab, k):
    """Vocabularies that end inside a 32-row block, hidden sizes that are not a multiple of 32,
    and more rows than one span (256) against float64; every row as it is alone."""
    g = torch.Generator().manual_seed(vocab + k)
    w = (torch.randn(vocab, k, generator=g) * 0.05).bfloat16()
    norm = (1 + 0.2 * torch.randn(k, generator=g)).bfloat16()
    packed = cpu_kernels.head_pack(w)
    for rows in (1, 7, 300):
        hidden = (torch.randn(rows, k, generator=g) * 3).bfloat16()
        got = cpu_kernels.head_logits(hidden, norm, 1e-5, packed, vocab)
        want = F.rms_norm(hidden.double(), (k,), norm.double(), 1e-5) @ w.double().T
        close(got, want, torch.float32)
        last = cpu_kernels.head_logits(hidden[-1:].clone(), norm, 1e-5, packed, vocab)
        assert torch.equal(last[0], got[-1])


@amx_only
def test_amx_head_refuses_a_pack_of_another_shape():
    packed = cpu_kernels.head_pack(torch.zeros(100, 64, dtype=torch.bfloat16))
    hidden, norm = torch.zeros(2, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="packed must be head_pack"):
        cpu_kernels.head_logits(hidden, norm, 1e-5, packed, 200)
    with pytest.raises(RuntimeError, match="bfloat16, expected"):
        cpu_kernels.head_logits(hidden.float(), norm, 1e-5, packed, 100)


@amx_only
@pytest.mark.parametrize("n,k", [(96, 576), (64, 40), (32, 1536)])
def test_amx_linear_is_the_float32_sum_rounded_once(n, k):
    """bf16 x @ W.T + bias on AMX tiles: float32 products and sums rounded once to bf16, for row
    counts off the 32-row pass and k off the 32-wide tile (zero-padded); each row as it is alone
    (a decode row's bits do not depend on its batch-mates)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    packed = cpu_kernels.amx_pack(w)
    for m in (1, 7, 32, 45, 100):
        x = torch.randn(m, k, generator=g).bfloat16()
        got = cpu_kernels.amx_linear(x, packed, bias)
        close(got, x.double() @ w.double().T + bias.double(), torch.bfloat16)
        close(cpu_kernels.amx_linear(x, packed), x.double() @ w.double().T, torch.bfloat16)
        for i in {0, m // 2, m - 1}:
            assert torch.equal(got[i], cpu_kernels.amx_linear(x[i:i + 1], packed, bias)[0])
    strided = torch.randn(9, 2 * k, generator=g).bfloat16()[:, :k]  # rows not dense
    assert torch.equal(cpu_kernels.amx_linear(strided, packed),
                       cpu_kernels.amx_linear(strided.contiguous(), packed))


@amx_only
@pytest.mark.parametrize("n,k", [(3072, 576), (64, 40), (128, 1536)])
def test_gated_amx_linear_is_silu_times_up_of_the_float32_sums_rounded_once(n, k):
    """W = [gate | up]: silu(x @ gate.T) * (x @ up.T) from the tiles' float32 sums, rounded
    once to bf16 (the unfused path rounds gate and up first, then the product); each row as it
    is alone; Linear.silu_and_mul takes it from SMALL_ROWS + 1 rows on, the two ops below."""
    from hotswap.engine.layers import linear as lin

    g = torch.Generator().manual_seed(13)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    packed = cpu_kernels.amx_pack(w)
    proj = lin.Linear(k, n, bias=False).bfloat16()
    proj.weight.data.copy_(w)
    proj.packed = lin.pack_linear(proj.weight)
    assert proj.gated_amx()
    for m in (1, 7, 32, 45, 100):
        x = torch.randn(m, k, generator=g).bfloat16()
        gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
        got = cpu_kernels.amx_linear(x, packed, gated=True)
        close(got, F.silu(gate) * up, torch.bfloat16)
        for i in {0, m // 2, m - 1}:
            assert torch.equal(got[i], cpu_kernels.amx_linear(x[i:i + 1], packed, gated=True)[0])
        want = got if m > lin.SMALL_ROWS else cpu_kernels.silu_and_mul(proj(x))
        assert torch.equal(proj.silu_and_mul(x), want)


@amx_only
def test_amx_copies_side_by_side_in_huge_pages_equal_each_pack():
    """amx_pack_all (a model's AMX copies, in one region kept across updates) and head_pack into
    a region give amx_pack's and head_pack's bits, k off the 32-wide tile included (its padding
    zeroed even where the region held other values), the copies side by side in order."""
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(n, k, generator=g).bfloat16() for n, k in
               [(3072, 576), (64, 40), (576, 1536)]]
    regions = {}
    first = cpu_kernels.amx_pack_all(weights, regions)
    region = regions["amx"]
    region.fill_(7.0)  # the next update writes into the same memory
    packs = cpu_kernels.amx_pack_all(weights, regions)
    assert regions["amx"] is region and packs[0].data_ptr() == first[0].data_ptr()
    for w, packed in zip(weights, packs):
        assert torch.equal(packed, cpu_kernels.amx_pack(w))
    assert packs[1].data_ptr() == packs[0].data_ptr() + packs[0].nbytes
    assert packs[2].data_ptr() == packs[1].data_ptr() + packs[1].nbytes
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert packs[0].data_ptr() % cpu_kernels.HUGE_PAGE == 0
    head = torch.randn(1000, 41, generator=g).bfloat16()  # rows padded to 32, k to 64
    into = torch.full(cpu_kernels.amx_shape(head), 3.0, dtype=torch.bfloat16)
    assert torch.equal(cpu_kernels.head_pack(head, into), cpu_kernels.head_pack(head))
    with pytest.raises(RuntimeError, match="out: a contiguous"):
        cpu_kernels.amx_pack(weights[1], torch.zeros(2, 32 * 32, dtype=torch.bfloat16))


@amx_only
def test_amx_linear_refuses_what_it_cannot_multiply():
    with pytest.raises(RuntimeError, match="n a multiple of 32"):
        cpu_kernels.amx_pack(torch.zeros(100, 64, dtype=torch.bfloat16))
    packed = cpu_kernels.amx_pack(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="amx_pack of a"):
        cpu_kernels.amx_linear(torch.zeros(2, 96, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.amx_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed,
                               torch.zeros(63, dtype=torch.bfloat16))
    odd = cpu_kernels.amx_pack(torch.zeros(96, 64, dtype=torch.bfloat16))  # 3 blocks
    with pytest.raises(RuntimeError, match="gated"):
        cpu_kernels.amx_linear(torch.zeros(2, 64, dtype=torch.bfloat16), odd, gated=True)
    with pytest.raises(RuntimeError, match="gated"):
        cpu_kernels.amx_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed,
                               torch.zeros(64, dtype=torch.bfloat16), gated=True)


@amx_only
def test_linear_takes_amx_up_to_amx_rows_then_onednn_over_the_plain_weight():
    """A Linear's pack of a bf16 weight on AMX is the AMX copy: linear() multiplies it for
    SMALL_ROWS < rows <= AMX_ROWS, small_linear below, oneDNN over the plain weight above, each
    the float32 product rounded once; a weight whose rows are not a multiple of 32 keeps
    oneDNN's pack."""
    from hotswap.engine.layers import linear as lin

    g = torch.Generator().manual_seed(12)
    w = torch.randn(96, 64, generator=g).bfloat16()
    packed = lin.pack_linear(w)
    assert lin.is_amx_pack(packed) and not lin.is_amx_pack(lin.pack_linear(w[:90]))
    for rows, path in ((lin.SMALL_ROWS, lin.SMALL), (lin.SMALL_ROWS + 1, lin.AMX),
                       (lin.AMX_ROWS, lin.AMX), (lin.AMX_ROWS + 1, lin.ONEDNN)):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        assert lin.matmul_path(x, w, packed=packed) == path
        close(lin.linear(x, w, packed=packed), x.double() @ w.double().T, torch.bfloat16)


def _runner(path: str, dtype: str) -> ModelRunner:
    mcfg = ModelConfig.from_path(path)
    cfg = EngineConfig(model_path=path, dtype=dtype, max_total_tokens=4096,
                       max_running_requests=16).resolve(mcfg)
    return ModelRunner(cfg, mcfg)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("limit", [AMX_EXTEND_MAX_KEYS, math.inf], ids=["amx", "no-amx"])
def test_model_through_kernels_equals_op_by_op(tiny_model_path, monkeypatch, dtype, limit):
    """A prefill of short prompts and decode-only steps (the fused layer; Qwen3's q/k norms keep
    the layer-by-layer path), steps with an extend row past 128 keys (on an AMX CPU padded SDPA
    beside the kernel, elsewhere the kernel: then every step runs fused) and decode steps of 3
    rows and 1 (bf16: small_linear) against the same model with the kernels off: float32 within
    float32 rounding, bf16 within bf16 rounding of the logits."""
    calls = []
    decode_layers = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers", lambda *a: calls.append(1) or
                        decode_layers(*a))
    fused = _runner(tiny_model_path, dtype)
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    plain = _runner(tiny_model_path, dtype)
    monkeypatch.setattr(cpu_kernels, "_loaded", True)
    fused.attn_backend.extend_max_keys = limit
    tokens = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate((20, 50, 200))]
    seqs = {r: [Seq(r, t) for t in tokens] for r in (fused, plain)}
    plans = ([[(0, 3), (1, 40)], [(2, 150), (0, 1)], [(1, 1), (2, 30)]]
             + [[(0, 1), (1, 1), (2, 1)]] * 3 + [[(1, 1)]])  # decode: bf16's small_linear
    tol = 1e-4 if dtype == "float32" else 0.1
    for plan in plans:
        a, b = ([run_step(r, [(seqs[r][i], n) for i, n in plan]) for r in (fused, plain)])
        for x, y in zip(a, b):
            assert (x - y).abs().max().item() < tol
    # the short prefill and four decode-only steps, all layers in one call each; without the
    # AMX limit the two steps with rows past 128 keys too
    assert len(calls) == (0 if fused.model_config.qk_norm else 5 if limit < 150 else 7)


def _team_equals_layer_by_layer(path: str, rows: int) -> None:
    from hotswap.engine.layers import linear as lin

    runner = _runner(path, "bfloat16")
    if runner.model_config.qk_norm:
        pytest.skip("Qwen3's q/k norms keep the layer-by-layer path")
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    x = torch.zeros(rows, qkv.weight.shape[1], dtype=torch.bfloat16)
    if lin.matmul_path(x, qkv.weight, qkv.bias, x, qkv.quant, qkv.blocked,
                       qkv.packed) != lin.SMALL:
        pytest.skip("few bf16 rows take small_linear only with AVX512-BF16 (else the blocked "
                    "kernel, layer by layer)")
    seqs = [Seq(runner, [(11 * r + 3 * j) % 256 for j in range(60)]) for r in range(rows)]
    run_step(runner, [(s, 20 + 9 * i) for i, s in enumerate(seqs)])
    threads = torch.get_num_threads()
    try:
        for _ in range(3):  # three decode steps, each under 1, 2 and 4 threads
            start = [(s.computed, s.last_loc) for s in seqs]
            logits, teams = {}, {}
            for n in (1, 2, 4):
                for s, (computed, last) in zip(seqs, start):
                    s.computed, s.last_loc = computed, last
                torch.set_num_threads(n)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                    logits[n] = torch.stack(run_step(runner, [(s, 1) for s in seqs],
                                                     all_logits=False))
                teams[n] = sum(e.name == "hotswap::small_layers" for e in p.events())
            layers = runner.model_config.num_layers
            assert teams == {1: 0, 2: layers + 1, 4: layers + 1}
            assert torch.equal(logits[1], logits[2]) and torch.equal(logits[1], logits[4])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_bf16_decode_with_the_threads_as_a_team_equals_the_layer_by_layer_step(tiny_model_path,
                                                                              rows):
    """A bf16 decode-only step of up to SMALL_ROWS rows keeps the threads in one region a layer
    (hotswap::small_layers): with 2 and 4 threads (more than this machine's cores: the waits
    must still move on) its logits equal bit for bit those of the same step with 1 thread, where
    each layer's ops run one by one (decode_layer). Each step is run again on the same tokens."""
    _team_equals_layer_by_layer(tiny_model_path, rows)


@pytest.mark.parametrize("rows", [1, 4])
def test_the_team_widens_x_where_k_is_not_a_multiple_of_32(tmp_path, rows):
    """Widths off AVX512-BF16's 32 (hidden 48, intermediate 80) take small_linear's float32 x,
    which each thread of the team widens for itself: still the op-by-op layer's bits."""
    from conftest import write_tiny_model

    _team_equals_layer_by_layer(write_tiny_model(str(tmp_path), "llama", hidden_size=48,
                                                 intermediate_size=80), rows)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extend_rows_past_128_keys_take_sdpa_only_in_bf16_on_amx(tiny_model_path, monkeypatch,
                                                                 amx, dtype):
    """The backend's limit on the keys of an extend row that takes the kernel: 128 for a bf16
    pool on an AMX CPU (its SDPA matmuls win past it), none elsewhere."""
    monkeypatch.setattr(torch_backend, "AMX_BF16", amx)
    runner = _runner(tiny_model_path, dtype)
    expected = AMX_EXTEND_MAX_KEYS if amx and dtype == "bfloat16" else math.inf
    assert runner.attn_backend.extend_max_keys == expected


def _scale_weights(runner: ModelRunner, factors: dict[str, float]) -> None:
    """Write new values into every weight the way an update does, then say so."""
    for name, slot in runner.model.hf_weight_map().items():
        slot.view.mul_(factors.setdefault(name, 0.5 + torch.rand(()).item()))
    runner.weights_changed()


@amx_only
def test_fused_amx_layers_fall_back_to_onednn_when_a_weight_has_no_amx_copy(tiny_model_path,
                                                                            monkeypatch):
    """The fused stack takes one path: AMX where every projection has an AMX copy; one weight
    left with oneDNN's pack (rows not a multiple of 32 would do it) puts the stack on oneDNN
    over the plain weights, and a decode step still matches the model without the kernels."""
    from hotswap.engine.layers import linear as lin

    fused = _runner(tiny_model_path, "bfloat16")
    if fused.model_config.qk_norm:
        pytest.skip("Qwen3's q/k norms keep the layer-by-layer path")
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    plain = _runner(tiny_model_path, "bfloat16")
    monkeypatch.setattr(cpu_kernels, "_loaded", True)
    paths = []
    stack = cpu_kernels.decode_stack
    monkeypatch.setattr(cpu_kernels, "decode_stack",
                        lambda layers, eps, path, heads: paths.append(path) or stack(
                            layers, eps, path, heads))
    seqs = {r: [Seq(r, [(5 * i + j) % 256 for j in range(40)]) for i in range(8)]
            for r in (fused, plain)}
    for r in (fused, plain):
        run_step(r, [(s, 30) for s in seqs[r]])
    for odd_one_out in (False, True):
        if odd_one_out:
            o_proj = fused.model.model.layers[-1].self_attn.o_proj
            o_proj.packed = lin.pack(o_proj.weight)
            fused.model.model.fused_layers.clear()
        a, b = ([run_step(r, [(s, 1) for s in seqs[r]]) for r in (fused, plain)])
        assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 0.1
    assert paths == [lin.AMX, lin.ONEDNN]


@pytest.mark.parametrize("dtype,rows", [("float32", 3), ("bfloat16", 3), ("bfloat16", 8)])
def test_fused_layers_follow_weight_updates_and_release(tiny_model_path, monkeypatch, dtype,
                                                        rows):
    """The fused layers hold the weights (and their packed copies, float32 and bf16 past
    SMALL_ROWS): after an update, and after release, resume and a rewrite, a fused decode step
    reads the new weights, as the op-by-op path does."""
    fused = _runner(tiny_model_path, dtype)
    if fused.model_config.qk_norm:
        pytest.skip("Qwen3's q/k norms keep the layer-by-layer path")
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    plain = _runner(tiny_model_path, dtype)
    monkeypatch.setattr(cpu_kernels, "_loaded", True)
    seqs = {r: [Seq(r, [(3 * i + j) % 256 for j in range(40)]) for i in range(rows)]
            for r in (fused, plain)}
    tol = 1e-4 if dtype == "float32" else 0.1

    def decode_matches() -> float:
        a, b = ([run_step(r, [(s, 1) for s in seqs[r]]) for r in (fused, plain)])
        assert fused.model.model.fused_layers  # the step did run fused
        worst = max((x - y).abs().max().item() for x, y in zip(a, b))
        assert worst < tol
        return torch.cat(a).abs().max().item()

    for r in (fused, plain):
        run_step(r, [(s, 30) for s in seqs[r]])
    before = decode_matches()
    factors: dict[str, float] = {}
    for r in (fused, plain):
        _scale_weights(r, factors)
    assert not fused.model.model.fused_layers  # dropped with the old packed copies
    assert decode_matches() != before
    saved = {n: s.view.clone() for n, s in fused.model.hf_weight_map().items()}
    fused.release_weights()
    assert not fused.model.pack_regions  # the blocked copies' memory goes with the weights
    fused.resume_weights()
    for name, slot in fused.model.hf_weight_map().items():
        slot.view.copy_(saved[name])
    fused.weights_changed()
    decode_matches()


def test_the_fused_layer_shows_its_parts_to_the_profiler(tiny_model_path):
    """bench/profile_step.py splits a decode step by op name: inside the fused layer, the
    attention, KV store, norms, rotary and activation run under their own names, once a layer
    each (twice for the norm), beside the layer's four matmuls."""
    runner = _runner(tiny_model_path, "float32")
    if runner.model_config.qk_norm:
        pytest.skip("Qwen3's q/k norms keep the layer-by-layer path")
    seqs = [Seq(runner, [(5 * r + j) % 256 for j in range(10)]) for r in range(2)]
    run_step(runner, [(s, 9) for s in seqs])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_step(runner, [(s, 1) for s in seqs])
    events = prof.events()
    fused = [e.time_range for e in events if e.name == "hotswap::decode_layer"]
    counts = {}
    for e in events:
        if any(r.start <= e.time_range.start and e.time_range.end <= r.end for r in fused):
            counts[e.name] = counts.get(e.name, 0) + 1
    layers = runner.model_config.num_layers
    assert len(fused) == layers
    assert sum(e.name == "hotswap::decode_layers" for e in events) == 1  # the step's one call
    for name, per_layer in (("hotswap::decode_attention", 1), ("hotswap::store_kv", 1),
                            ("hotswap::rotary_", 1), ("hotswap::silu_and_mul", 1),
                            ("hotswap::rms_norm", 2)):
        assert counts.get(name) == per_layer * layers, (name, counts.get(name))


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    """A build killed midway leaves torch's lock file behind; later loads would wait forever."""
    lock = tmp_path / "lock"
    lock.touch()
    kernel_build._drop_stale_lock(lock)
    assert lock.exists()  # a build may be running right now
    old = time.time() - kernel_build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    kernel_build._drop_stale_lock(lock)
    assert not lock.exists()
    kernel_build._drop_stale_lock(lock)  # nothing there: nothing to do


def test_a_finished_build_loads_without_ninja_or_a_compiler(monkeypatch):
    """After `make setup` (or any first build) an Engine's start loads the library as it is."""
    assert kernel_build.build_spec().ready.exists()
    monkeypatch.setattr(kernel_build.shutil, "which", lambda tool: None)
    assert kernel_build.build()


def test_missing_sources_fall_back_with_the_reason_logged(tmp_path, monkeypatch, caplog):
    """An install without csrc/ (or a failed build) runs the torch ops, saying why."""
    monkeypatch.setattr(kernel_build, "SOURCE_DIR", tmp_path)
    with caplog.at_level("WARNING", logger=kernel_build.__name__):
        assert kernel_build.build() is False
    assert "no kernel sources" in caplog.text



def test_setup_removes_old_builds_and_nothing_else(tmp_path, monkeypatch, capsys):
    """Every source edit, torch version and flag change leaves a 2.5 MB build behind; `make
    setup` keeps each ISA's current build, another CPU's native build of this source (a cache
    shared by machines) and a build under way, and touches nothing else in the folder."""
    root = tmp_path / "ext"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    old_time = time.time() - 2 * kernel_build.STALE_LOCK_S

    def build(name: str, ready: str = "", fresh: bool = False) -> Path:
        folder = root / name
        (folder / "src").mkdir(parents=True)
        (folder / f"{name}.so").write_bytes(b"\0" * 64)
        (folder / "ready").write_text(ready)
        if not fresh:
            os.utime(folder, (old_time, old_time))
        return folder

    current = [build(kernel_build.build_name(isa)) for isa in kernel_build.MARCH]
    other_cpu = build("hotswap_cpu_kernels_native_0123456789ab",
                      ready=kernel_build._build_key("native"))
    under_way = build("hotswap_cpu_kernels_avx2_00000000000a", fresh=True)
    edited = tmp_path / "csrc"
    shutil.copytree(kernel_build.SOURCE_DIR, edited)
    (edited / "rope.cpp").write_text((edited / "rope.cpp").read_text() + "\n")
    with monkeypatch.context() as m:
        m.setattr(kernel_build, "SOURCE_DIR", edited)
        old = [build(kernel_build.build_name("native"))]
        m.setattr(kernel_build.torch, "__version__", "2.8.0")
        old.append(build(kernel_build.build_name("avx2"), ready=kernel_build._build_key("avx2")))
    others = [root / "hotswap_cpu_kernels_avx2_0000000000bb", root / "hotswap_cpu_kernels_v1",
              root / "my_extension", root / "hotswap_cpu_kernels_avx512_0000000000cc"]
    others[0].write_text("a file with a build's name")
    for folder in others[1:3]:
        folder.mkdir()
        os.utime(folder, (old_time, old_time))
    others[3].symlink_to(build("elsewhere"), target_is_directory=True)

    cpu_kernels.main()

    assert sorted(p for p in root.iterdir() if p.exists()) == sorted(
        [*current, other_cpu, under_way, *others, root / "elsewhere"])
    assert f"removed {len(old)} old kernel builds from {root}" in capsys.readouterr().out
