"""The MoE layer: routing equals HF's routers, the grouped experts equal a per-token reference and
HF's sparse blocks, the C++ kernel gives the torch path's bits, replayed ids reproduce the output,
and the Triton kernel (under the interpreter without CUDA) equals the torch path."""

from __future__ import annotations

import pytest
import torch
import transformers

# Without CUDA the kernels run under Triton's interpreter: conftest.py sets TRITON_INTERPRET.
from hotswap.engine.layers import cpu_kernels, linear, moe_triton
from hotswap.engine.layers.linear import pack
from hotswap.engine.layers.moe import (
    ExpertPacks,
    FusedMoE,
    Routing,
    can_block,
    fused_experts,
    grouped_experts,
    quantize_experts,
    select_experts,
)

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 9, 32, 16, 6, 2


def naive(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing
          ) -> torch.Tensor:
    """Token by token, slot by slot, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(len(x)):
        for e, w in zip(routing.topk_ids[t].tolist(), routing.topk_weights[t].float()):
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += w * (w2[e].float() @ (torch.nn.functional.silu(gate) * up))
    return out


def random_case(dtype: torch.dtype, seed: int = 0, tokens: int = TOKENS, experts: int = EXPERTS,
                top_k: int = TOP_K):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    w13 = (0.2 * torch.randn(experts, 2 * INTER, HIDDEN, generator=gen)).to(dtype)
    w2 = (0.2 * torch.randn(experts, HIDDEN, INTER, generator=gen)).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen).to(dtype)
    return x, w13, w2, select_experts(logits, top_k, True, dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("tokens,top_k", [(TOKENS, TOP_K), (1, 4), (3, 1)])
def test_grouped_experts_equal_a_per_token_reference(dtype, tol, tokens, top_k):
    x, w13, w2, routing = random_case(dtype, tokens=tokens, top_k=top_k)
    got = grouped_experts(x, w13, w2, routing)
    assert got.dtype == dtype and got.shape == x.shape
    want = naive(x, w13, w2, routing)
    assert torch.allclose(got.float(), want, atol=tol * want.abs().max().item(), rtol=0)


def packs_of(packing: str, w13: torch.Tensor, w2: torch.Tensor) -> ExpertPacks | None:
    if packing == "onednn":
        return ExpertPacks([pack(w) for w in w13], [pack(w) for w in w2])
    if packing == "blocked":
        if not can_block(w13, w2):
            pytest.skip("the blocked kernel needs AVX-512 (and AVX512-BF16 for bf16)")
        return ExpertPacks([], [], cpu_kernels.block_pack(w13), cpu_kernels.block_pack(w2))
    return None


@pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packing", ["none", "onednn", "blocked"])
@pytest.mark.parametrize("tokens,top_k", [(64, 2), (TOKENS, TOP_K), (1, 4), (3, 1)])
def test_the_cpu_kernel_gives_the_torch_paths_bits(dtype, packing, tokens, top_k):
    """Same ops, same paths (the blocked kernel where the experts are in the blocked layout, the
    small-batch kernel for a bf16 expert of a few rows, oneDNN packed or plain otherwise), so the
    same bits; Mixtral's float32 weights too."""
    x, w13, w2, routing = random_case(dtype, tokens=tokens, top_k=top_k)
    packs = packs_of(packing, w13, w2)
    for weights_dtype in (dtype, torch.float32):
        routed = Routing(routing.topk_ids, routing.topk_weights.to(weights_dtype))
        want = grouped_experts(x, w13, w2, routed, packs)
        with torch.inference_mode():
            assert torch.equal(fused_experts(x, w13, w2, routed, packs), want)


@pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built")
def test_where_onednn_runs_no_bf16_the_kernel_takes_f_linear_as_torch_does(monkeypatch):
    """A CPU without AVX-512 (HOTSWAP_CPU_ISA=avx2): an expert's bf16 rows past the small-batch
    kernel's take F.linear on both paths, and pack() has nothing to pack."""
    monkeypatch.setattr(linear, "_ONEDNN_DTYPES", (torch.float32,))
    x, w13, w2, routing = random_case(torch.bfloat16, tokens=64, experts=2, top_k=2)
    packs = ExpertPacks([pack(w) for w in w13], [pack(w) for w in w2])
    assert packs.w13[0] is None
    for given in (packs, None):
        want = grouped_experts(x, w13, w2, routing, given)
        with torch.inference_mode():
            assert torch.equal(fused_experts(x, w13, w2, routing, given), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 32, 32), (13, 64, 34), (30, 96, 512)])
def test_the_blocked_kernel_multiplies_what_the_layout_holds(dtype, m, n, k):
    """blocked_linear over block_pack(w) equals x @ w.T summed in float32 and rounded once to
    x's dtype, past 12 rows of x (a second tile) and for k not a multiple of 32."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(1, n, k, generator=gen).to(dtype)
    if not can_block(w, w):
        pytest.skip("the blocked kernel needs AVX-512 (and AVX512-BF16 for bf16)")
    got = cpu_kernels.blocked_linear(x, cpu_kernels.block_pack(w)[0])
    want = x.double() @ w[0].double().T
    assert got.dtype == dtype and got.shape == (m, n)
    # float32 sums (and one rounding to bf16): within float32's error of a k-term sum, or bf16's.
    ulp = 2 ** -8 if dtype == torch.bfloat16 else 0.0
    err = (got.double() - want).abs()
    assert (err <= ulp * want.abs() + 1e-5 * k).all(), err.max()
    with pytest.raises(RuntimeError, match="blocked layout"):
        cpu_kernels.blocked_linear(x[:, :-2], cpu_kernels.block_pack(w)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_keeps_its_experts_in_the_blocked_layout_where_the_kernel_applies(dtype):
    layer = FusedMoE(HIDDEN, INTER, EXPERTS, TOP_K, True, False).to(dtype)
    torch.nn.init.normal_(layer.w13)
    torch.nn.init.normal_(layer.w2)
    layer.pack_weights(True)
    group = 4 // layer.w13.element_size()
    if can_block(layer.w13, layer.w2):
        assert layer.packs.w13 == []
        assert layer.packs.blocked13.shape == (EXPERTS, 1, HIDDEN // group, 32, group)
        # block 0, input group 5, output 7: w13[e, 7, 5 * group: 6 * group]
        assert torch.equal(layer.packs.blocked13[2, 0, 5, 7],
                           layer.w13[2, 7, 5 * group: 6 * group].detach())
    else:
        assert layer.packs is None or layer.packs.blocked13 is None
    layer.pack_weights(False)
    assert layer.packs is None


@pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(64, 2), (TOKENS, TOP_K), (1, 4)])
def test_int8_experts_give_the_torch_paths_bits_close_to_float(dtype, tokens, top_k):
    """quantization="int8": every expert's two matmuls take its int8 copies (int8_linear), in the
    C++ kernel as in torch, with the same bits; the result within int8's error of the float
    experts."""
    x, w13, w2, routing = random_case(dtype, tokens=tokens, top_k=top_k)
    quant = quantize_experts(w13, w2)
    assert quant.w13.dtype == quant.w2.dtype == torch.int8
    assert quant.w13.shape == w13.shape and quant.scale2.shape == w2.shape[:2]
    want = grouped_experts(x, w13, w2, routing, quant=quant)
    with torch.inference_mode():
        assert torch.equal(fused_experts(x, w13, w2, routing, quant=quant), want)
    ref = naive(x, w13, w2, routing)
    err = (want.float() - ref).abs().max() / ref.abs().max()
    assert err < 0.05, err
    assert (want.float() - grouped_experts(x, w13, w2, routing).float()).abs().max() > 0


def test_an_int8_layer_keeps_no_packed_copy_and_its_vnni_layout_holds_the_int8_copy():
    layer = FusedMoE(HIDDEN, INTER, EXPERTS, TOP_K, True, False)
    torch.nn.init.normal_(layer.w13)
    torch.nn.init.normal_(layer.w2)
    assert layer.quantize(True) == layer.quant.nbytes
    quant = layer.quant
    assert quant.w13.shape == (EXPERTS, 2 * INTER, HIDDEN) and quant.w13.dtype == torch.int8
    if quant.blocked13 is not None:  # AVX512-VNNI: block 0, input group 5, output 7
        assert quant.blocked13.shape == (EXPERTS, 1, HIDDEN // 4, 32, 4)
        assert torch.equal(quant.blocked13[2, 0, 5, 7], quant.w13[2, 7, 20:24])
        assert torch.equal(quant.comp2, 128 * quant.w2.sum(2, dtype=torch.int32))
    layer.pack_weights(True)
    assert layer.packs is None
    assert layer.quantize(False) == 0 and layer.quant is None


def test_idle_experts_are_never_multiplied(monkeypatch):
    from hotswap.engine.layers import moe

    x, w13, w2, _ = random_case(torch.float32, experts=8)
    routing = select_experts(torch.tensor([[0.0, 0, 0, 9, 0, 0, 0, 8]] * 4), 2, True,
                             torch.float32)
    calls = []
    real = moe.linear
    monkeypatch.setattr(moe, "linear",
                        lambda a, w, **kw: calls.append(len(a)) or real(a, w, **kw))
    grouped_experts(x[:4], w13, w2, routing)
    assert calls == [4, 4, 4, 4]  # experts 3 and 7, all four tokens each: gate_up, then down


def hf_config(arch: str, norm_topk_prob: bool = True):
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=TOP_K, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, num_hidden_layers=1)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=INTER,
                                          num_local_experts=EXPERTS)
    return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=INTER,
                                       num_experts=EXPERTS, norm_topk_prob=norm_topk_prob)


def hf_block(arch: str, norm_topk_prob: bool, dtype: torch.dtype) -> torch.nn.Module:
    cfg = hf_config(arch, norm_topk_prob)
    torch.manual_seed(1)
    if arch == "mixtral":
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
    else:
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block.to(dtype).eval()


def ours_like(block: torch.nn.Module, arch: str, norm_topk_prob: bool) -> FusedMoE:
    layer = FusedMoE(HIDDEN, INTER, EXPERTS, TOP_K, renormalize=norm_topk_prob,
                     fp32_weights=arch == "mixtral").to(block.gate.weight.dtype)
    with torch.no_grad():
        layer.gate.weight.copy_(block.gate.weight)
        layer.w13.copy_(block.experts.gate_up_proj)
        layer.w2.copy_(block.experts.down_proj)
    return layer


@pytest.mark.parametrize("arch,norm", [("qwen3_moe", False), ("qwen3_moe", True),
                                       ("mixtral", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_equals_hf_sparse_block(arch, norm, dtype):
    block = hf_block(arch, norm, dtype)
    layer = ours_like(block, arch, norm)
    x = torch.randn(1, 11, HIDDEN).to(dtype)
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x.view(-1, HIDDEN))
        want = block(x).view(-1, HIDDEN)
    routing = layer.route(x.view(-1, HIDDEN))
    # The router exactly: the same experts, the same weights in the same dtype.
    assert torch.equal(routing.topk_ids, hf_ids)
    assert routing.topk_weights.dtype == hf_weights.dtype
    assert torch.equal(routing.topk_weights, hf_weights)
    got = layer(x.view(-1, HIDDEN)).hidden
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=0)


def test_replayed_ids_reproduce_the_output_and_other_ids_route_there():
    block = hf_block("qwen3_moe", True, torch.float32)
    layer = ours_like(block, "qwen3_moe", True)
    x = torch.randn(7, HIDDEN)
    first = layer(x)
    again = layer(x, topk_ids=first.topk_ids)
    assert torch.equal(again.hidden, first.hidden) and torch.equal(again.topk_ids, first.topk_ids)
    # Other experts: the given ids are used, weighted by the router's own probabilities there.
    other = (first.topk_ids + 1) % EXPERTS
    replayed = layer(x, topk_ids=other)
    assert torch.equal(replayed.topk_ids, other)
    probs = torch.softmax(layer.gate(x), dim=-1).gather(1, other)
    want = naive(x, layer.w13.detach(), layer.w2.detach(),
                 Routing(other, probs / probs.sum(-1, keepdim=True)))
    assert torch.allclose(replayed.hidden, want, atol=1e-5)
    with pytest.raises(ValueError, match="topk_ids has shape"):
        layer(x, topk_ids=other[:3])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens,experts,top_k", [(TOKENS, EXPERTS, TOP_K), (1, 4, 4),
                                                  (20, 3, 1)])
def test_triton_kernel_equals_the_torch_path(dtype, tol, tokens, experts, top_k):
    x, w13, w2, routing = random_case(dtype, seed=2, tokens=tokens, experts=experts, top_k=top_k)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    want = grouped_experts(x, w13, w2, routing)
    on = Routing(*(t.to(device) for t in routing))
    got = moe_triton.fused_experts(x.to(device), w13.to(device), w2.to(device), *on)
    assert got.dtype == dtype
    assert torch.allclose(got.cpu().float(), want.float(),
                          atol=tol * want.abs().max().item(), rtol=0)


def test_alignment_pads_each_expert_to_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # expert 0: 2 slots, 1: 1, 2: 3
    al = moe_triton.align(ids, num_experts=4, block_m=2)
    experts = al.block_experts.tolist()
    slots = al.sorted_slots.tolist()
    assert experts[:4] == [0, 1, 2, 2] and set(experts[4:]) == {4}  # 4: past the last run
    assert slots[:8] == [1, 4, 3, 6, 0, 2, 5, 6]  # 6 = no slot (padding)
    assert set(slots[8:]) == {6}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_compiled_kernel_at_decode_and_prefill_sizes(dtype, tol):
    assert not moe_triton.INTERPRETED
    gen = torch.Generator().manual_seed(3)
    for tokens in (1, 64, 1000):
        x = torch.randn(tokens, 512, generator=gen).to(dtype)
        w13 = (0.05 * torch.randn(32, 2 * 256, 512, generator=gen)).to(dtype)
        w2 = (0.05 * torch.randn(32, 512, 256, generator=gen)).to(dtype)
        routing = select_experts(torch.randn(tokens, 32, generator=gen), 4, True, dtype)
        want = grouped_experts(x, w13, w2, routing)
        got = moe_triton.fused_experts(x.cuda(), w13.cuda(), w2.cuda(),
                                       *(t.cuda() for t in routing))
        assert torch.allclose(got.cpu().float(), want.float(),
                              atol=tol * want.abs().max().item(), rtol=0)
