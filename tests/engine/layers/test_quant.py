"""int8 linear layers (engine/layers/quant.py) and an int8 engine against HF fp32."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from fixtures import write_tiny_chat_model

from hotswap.engine import Engine
from hotswap.engine.layers import cpu_kernels, quant
from hotswap.engine.layers.linear import INT8, Linear, linear, matmul_path, quantized_linears


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("quant")))


SHAPES = [(1, 64, 96), (5, 576, 960), (64, 1536, 576), (3, 48, 40), (2, 100, 30)]


def error_bound(x: torch.Tensor, qw: quant.QuantWeight, w: torch.Tensor) -> torch.Tensor:
    """Per output element: rounding x H and W H to their int8 grids moves each product by at
    most half a step of one factor times the other: |xH| . s_w / 2 + s_x / 2 . |W H| (+ the
    cross term), summed over k."""
    xh, wh = quant.rotate(x.float()), quant.rotate(w.float())
    s_x = xh.abs().amax(1, keepdim=True) / 127
    return (xh.abs() @ (qw.scale[:, None] / 2).expand_as(wh).T
            + (s_x / 2) * wh.abs().sum(1) + s_x / 2 * qw.scale / 2 * x.shape[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_linear_within_quantization_error(m, k, n, dtype):
    torch.manual_seed(m * k + n)
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k) * 0.05
    bias, residual = torch.randn(n).to(dtype), torch.randn(m, n).to(dtype)
    qw = quant.quantize_weight(w.to(dtype))
    assert qw.weight.dtype == torch.int8 and qw.weight.is_contiguous()
    assert qw.weight.shape == (n, k) and qw.scale.shape == (n,)
    assert qw.weight.abs().max() <= 127
    out = quant.int8_linear(x, qw, bias, residual)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = x.double() @ w.to(dtype).double().T + bias.double() + residual.double()
    slack = 0.01 if dtype == torch.bfloat16 else 1e-4  # the output's own rounding
    bound = error_bound(x, qw, w.to(dtype)).double() + slack * (ref.abs() + 1)
    assert ((out.double() - ref).abs() <= bound).all()


def test_dequantize_round_trip():
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    qw = quant.quantize_weight(w)
    # Rotation is orthogonal: the error in the rotated frame is at most half a step per entry.
    err = quant.rotate(quant.dequantize(qw) - w)
    assert (err.abs() <= qw.scale[:, None] / 2 + 1e-6).all()


def test_kernel_matches_torch_ops(monkeypatch):
    """The CPU kernels and the torch-ops fallback compute the same thing (up to a rounding tie
    in the rotation)."""
    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    torch.manual_seed(1)
    x, w = torch.randn(7, 192), torch.randn(48, 192) * 0.1
    qw = quant.quantize_weight(w)
    fast = quant.int8_linear(x, qw)
    monkeypatch.setattr(cpu_kernels, "applies", lambda t: False)
    qw_slow = quant.quantize_weight(w)
    assert (qw_slow.weight.int() - qw.weight.int()).abs().max() <= 1
    torch.testing.assert_close(qw_slow.scale, qw.scale)
    torch.testing.assert_close(quant.int8_linear(x, qw), fast, atol=2e-3, rtol=1e-3)


def test_rows_are_independent():
    """Per-token scales: a row's output does not depend on its batch-mates."""
    torch.manual_seed(2)
    x, w = torch.randn(9, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    qw = quant.quantize_weight(w)
    x[3] *= 100  # an outlier row sets only its own scale
    together = quant.int8_linear(x, qw)
    alone = torch.cat([quant.int8_linear(x[i: i + 1], qw) for i in range(len(x))])
    assert torch.equal(together, alone)


@pytest.mark.skipif(not quant.can_vnni(torch.empty(32, 4)),
                    reason="needs AVX512-VNNI and the CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vnni_kernel_gives_the_int_mm_bits(dtype):
    """With AVX512-VNNI an int8 copy also holds the blocked layout, which steps of up to 32 rows
    multiply with csrc's VNNI kernel (x as u8, less the compensation): exact int32 sums, so the
    bits of torch._int_mm's path, with bias and residual, at every row count around the
    kernel's 12-row tile and the 32-row threshold."""
    torch.manual_seed(5)
    w = torch.randn(96, 1536).to(dtype) * 0.05
    qw = quant.quantize_weight(w)
    q = qw.weight
    assert qw.blocked.shape == (3, 384, 32, 4)
    assert torch.equal(qw.blocked[2, 17, 5, 3], q[2 * 32 + 5, 17 * 4 + 3])
    assert torch.equal(qw.blocked.permute(0, 2, 1, 3).reshape(96, 1536), q)
    assert torch.equal(qw.blocked, cpu_kernels.block_pack(q))
    assert torch.equal(qw.comp, 128 * q.int().sum(1))
    plain = qw._replace(blocked=None, comp=None)
    for m in (1, 2, 11, 12, 13, 25, 32, 33):
        x = torch.randn(m, 1536).to(dtype)
        bias, residual = torch.randn(96).to(dtype), torch.randn(m, 96).to(dtype)
        assert torch.equal(quant.int8_linear(x, qw, bias, residual),
                           quant.int8_linear(x, plain, bias, residual)), m
    for m in (2, 40):  # a copy that does not fit is refused whichever path the rows take
        with pytest.raises(RuntimeError, match="blocked layout"):
            quant.int8_linear(torch.randn(m, 1536).to(dtype), qw._replace(comp=qw.comp[:32]))


def test_zero_rows_and_hadamard_block():
    assert [quant.hadamard_block(k) for k in (64, 576, 1536, 48, 30, 7, 2048)] == [
        64, 64, 512, 16, 2, 1, 512]
    h = quant.hadamard(16)
    torch.testing.assert_close(h @ h.T, torch.eye(16))
    qw = quant.quantize_weight(torch.randn(4, 64))
    out = quant.int8_linear(torch.zeros(2, 64), qw)
    assert torch.equal(out, torch.zeros(2, 4))


def test_linear_takes_the_int8_copy():
    lin = Linear(64, 32, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.1)
    x = torch.randn(3, 64)
    assert matmul_path(x, lin.weight) != INT8
    lin.quant = quant.quantize_weight(lin.weight.detach())
    assert matmul_path(x, lin.weight, quant=lin.quant) == INT8
    torch.testing.assert_close(lin(x), quant.int8_linear(x, lin.quant))
    assert torch.equal(linear(x, lin.weight, quant=lin.quant), lin(x))


@pytest.mark.parametrize("int8_dot", [True, False])
def test_int8_sums_stay_exact_where_onednn_would_saturate(monkeypatch, int8_dot):
    """Without int8 dot products (AVX2, HOTSWAP_CPU_ISA=avx2) oneDNN's int8 kernels sum pairs of
    products in int16, which saturates beyond +-64; the sums int8_linear uses stay exact."""
    if int8_dot and not quant.INT8_DOT:
        pytest.skip("no int8 dot products on this CPU")
    monkeypatch.setattr(quant, "INT8_DOT", int8_dot)
    q = torch.full((3, 64), 127, dtype=torch.int8)
    q[1], q[2, ::2] = -127, -128
    w = torch.full((32, 64), -127, dtype=torch.int8)
    w[::3] = 127
    assert torch.equal(quant.int8_sums(q, w), (q.long() @ w.long().T).int())


def test_fast_path_reason(monkeypatch):
    quant.fast_path.cache_clear()
    monkeypatch.setattr(quant, "read_cpu_flags", lambda: {"avx2"})
    fast, why = quant.fast_path()
    assert not fast and "avx512_vnni" in why
    quant.fast_path.cache_clear()


def test_config_refuses_bad_quantization(model_path):
    with pytest.raises(ValueError, match="quantization"):
        Engine(model_path, quantization="int4")
    with pytest.raises(ValueError, match="quantize_lm_head"):
        Engine(model_path, quantize_lm_head=True)


def hf_logprobs(path: str, prompt: list[int], ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
    return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_engine_close_to_fp32(model_path, dtype):
    """Greedy tokens mostly those of the fp32 engine; logprobs of what it sampled close to HF
    fp32's; the int8 copies cover every linear but the lm_head."""
    prompts = [[1, 5 + i, 9, 17 + 2 * i, 33] for i in range(4)]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with Engine(model_path, dtype="float32", max_total_tokens=2048) as ref:
        expected = [o["output_ids"] for o in ref.generate(input_ids=prompts,
                                                          sampling_params=params)]
    with Engine(model_path, dtype=dtype, quantization="int8",
                max_total_tokens=2048) as engine:
        model = engine.scheduler.runner.model
        linears = list(quantized_linears(model))
        assert linears and all(m.quant is not None and m.packed is None for m in linears)
        assert model.lm_head_quant is None
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    got = [o["output_ids"] for o in outs]
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    assert same >= 0.75 * sum(map(len, expected))
    for prompt, out in zip(prompts, outs):
        ours = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
        diff = (ours - hf_logprobs(model_path, prompt, out["output_ids"])).abs()
        assert diff.mean() < 0.05 and diff.max() < 0.3, diff


def test_int8_head_and_fused_decode_match_op_by_op(model_path):
    """The fused decode step multiplies the same int8 copies as the op-by-op layers (the first
    decode step of a request vs its prefill's last row), and the int8 lm_head option works."""
    prompt = [1, 7, 9, 11, 13]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Engine(model_path, dtype="float32", quantization="int8", quantize_lm_head=True,
                max_total_tokens=2048, enable_prefix_cache=False) as engine:
        assert engine.scheduler.runner.model.lm_head_quant is not None
        out = engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True)
        ids = out["output_ids"]
        # Recompute the whole sequence as one prefill: op by op, the same int8 matmuls.
        again = engine.generate(input_ids=prompt + ids[:-1], sampling_params={
            "max_new_tokens": 1, "temperature": 0, "ignore_eos": True}, return_logprob=True)
    assert again["output_ids"] == ids[-1:]
    lp_decode = out["meta_info"]["output_token_logprobs"][-1][0]
    lp_prefill = again["meta_info"]["output_token_logprobs"][0][0]
    assert math.isclose(lp_decode, lp_prefill, abs_tol=1e-4)


def test_int8_composes_with_grammar_n_and_prefix_cache(model_path):
    prompt = [1, 7, 9, 11, 13, 15, 17, 19]
    with Engine(model_path, dtype="float32", quantization="int8",
                max_total_tokens=2048) as engine:
        outs = engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 8, "n": 3, "regex": "[0-9]{2,4}", "seed": 1})
        assert len(outs) == 3
        assert all(o["text"].isdigit() and 2 <= len(o["text"]) <= 4 for o in outs)
        again = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 2})
        assert again["meta_info"]["cached_tokens"] > 0
        engine.check_integrity()
