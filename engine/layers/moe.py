"""Mixture-of-experts layer: a softmax top-k router over SwiGLU experts (Qwen3-MoE, Mixtral).

Routing follows HF transformers exactly: router logits in the model dtype, softmax in float32,
top-k, the k probabilities renormalised where the model says so, then cast to the model dtype
(Qwen3-MoE) or kept in float32 (Mixtral) before they scale the expert outputs.

The experts run grouped: the (token, slot) pairs are sorted by expert id, and on CPU every expert
that got tokens multiplies its rows in one matmul (no loop over idle experts, none over tokens);
on CUDA a Triton kernel runs all of them as one grouped GEMM (moe_triton.py). Each token's k
outputs are summed in ascending expert order, as HF's index_add_ loop does. On a CPU with
AVX-512 the experts are also kept in a blocked layout (block_pack) for csrc/moe.cpp's kernel.

Routing replay: given `topk_ids` are used instead of the router's choice, with weights still read
from the router's probabilities at those ids, so the same ids reproduce the same output bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from hotswap.engine.cpu_features import read_cpu_flags
from hotswap.engine.layers import cpu_kernels
from hotswap.engine.layers.activation import silu_and_mul
from hotswap.engine.layers.cpu_kernels import BLOCK, block_pack
from hotswap.engine.layers.linear import (
    ATEN,
    ONEDNN,
    SMALL_ROWS,
    can_pack,
    linear,
    pack,
    uses_onednn,
)
from hotswap.engine.layers.quant import (
    QuantWeight,
    can_vnni,
    int8_linear,
    quantize_weight,
)


class Routing(NamedTuple):
    topk_ids: torch.Tensor  # [tokens, top_k] int64 expert ids, the router's order
    topk_weights: torch.Tensor  # [tokens, top_k] what scales each expert's output


class MoEOutput(NamedTuple):
    hidden: torch.Tensor  # [tokens, hidden]
    topk_ids: torch.Tensor  # [tokens, top_k]: the experts used (to record, or to replay)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   weights_dtype: torch.dtype, topk_ids: torch.Tensor | None = None) -> Routing:
    """The router's top-k experts and their weights; with `topk_ids`, those experts instead."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    if topk_ids is None:
        weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    else:
        weights = probs.gather(1, topk_ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(topk_ids, weights.to(weights_dtype))


class ExpertPacks(NamedTuple):
    """Caches of the experts' weights, rebuilt whenever the weights change: w13 and w2 whole in
    the blocked layout where its kernel applies, else pack() of every expert's w13 and w2
    (layers/linear.py)."""

    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    blocked13: torch.Tensor | None = None
    blocked2: torch.Tensor | None = None


CPU_FLAGS = read_cpu_flags()
AVX512_BF16 = "avx512_bf16" in CPU_FLAGS
# Without the blocked layout, a bf16 expert of at most this many rows takes the small-batch kernel
# (layers/linear.py's SMALL path): the experts of a step run one per thread, where it streams an
# expert's weights faster than oneDNN up to ~32-48 rows (AVX512-BF16 EPYC, bench/moe.py's shapes;
# without AVX512-BF16 unmeasured, so the dense threshold).
EXPERT_SMALL_ROWS = 32 if AVX512_BF16 else SMALL_ROWS


def can_block(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the experts take the blocked kernel: bf16 with AVX512-BF16 or float32 with
    AVX-512, every output count a multiple of BLOCK and every input count of G (block_pack)."""
    flag = {torch.bfloat16: "avx512_bf16", torch.float32: "avx512f"}.get(w13.dtype)
    group = 4 // w13.element_size()
    return (flag in CPU_FLAGS and w13.dtype == w2.dtype and cpu_kernels.applies(w13)
            and all(w.shape[1] % BLOCK == 0 and w.shape[2] % group == 0 for w in (w13, w2)))


class ExpertQuant(NamedTuple):
    """The int8 copies of every expert's w13 and w2 (quantization="int8"; layers/quant.py: per
    output channel, rotated along k), rebuilt with the int8 copies of the linear layers; on a
    CPU with AVX512-VNNI also in the int8 blocked layout (quant.py's QuantWeight) for csrc's
    VNNI kernel, which every expert then runs on (exact int32 sums: torch._int_mm's bits)."""

    w13: torch.Tensor  # int8 [E, 2I, H]
    scale13: torch.Tensor  # float32 [E, 2I]
    w2: torch.Tensor  # int8 [E, H, I]
    scale2: torch.Tensor  # float32 [E, H]
    blocked13: torch.Tensor | None = None  # int8 [E, 2I / 32, H / 4, 32, 4]
    comp13: torch.Tensor | None = None  # int32 [E, 2I]
    blocked2: torch.Tensor | None = None  # int8 [E, H / 32, I / 4, 32, 4]
    comp2: torch.Tensor | None = None  # int32 [E, H]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self if t is not None)

    def tensors(self) -> list[torch.Tensor]:
        """What cpu_kernels.moe_experts takes: the four copies, then the blocked four if any."""
        return [t for t in self if t is not None]

    def flat(self) -> tuple[QuantWeight, QuantWeight]:
        """w13's and w2's copies as one int8 copy each of the stacked weights [E * n, k]
        (views: quantize_weight writes through them)."""
        def stacked(w, scale, blocked, comp):
            return QuantWeight(w.flatten(0, 1), scale.flatten(),
                               None if blocked is None else blocked.flatten(0, 1),
                               None if comp is None else comp.flatten())

        return (stacked(self.w13, self.scale13, self.blocked13, self.comp13),
                stacked(self.w2, self.scale2, self.blocked2, self.comp2))

    def expert(self, e: int) -> tuple[QuantWeight, QuantWeight]:
        def of_e(*tensors):
            return QuantWeight(*(None if t is None else t[e] for t in tensors))

        return (of_e(self.w13, self.scale13, self.blocked13, self.comp13),
                of_e(self.w2, self.scale2, self.blocked2, self.comp2))


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, out: ExpertQuant | None = None
                     ) -> ExpertQuant:
    """Every expert's rows quantized as one linear weight's would be (rows are independent):
    the stacked weights as one int8 copy each, viewed per expert; into `out`'s memory where it
    holds copies of the same shapes."""
    (e, two_i, hidden), inter = w13.shape, w2.shape[2]
    vnni = can_vnni(w13) and can_vnni(w2)  # per expert: no block of 32 rows spans two experts
    old13, old2 = out.flat() if out is not None else (None, None)
    q13 = quantize_weight(w13.reshape(e * two_i, hidden), old13, vnni)
    q2 = quantize_weight(w2.reshape(e * hidden, inter), old2, vnni)

    def per_expert(q: QuantWeight, n: int, k: int) -> tuple[torch.Tensor | None, ...]:
        return (q.weight.view(e, n, k), q.scale.view(e, n),
                None if q.blocked is None else q.blocked.view(e, n // BLOCK, k // 4, BLOCK, 4),
                None if q.comp is None else q.comp.view(e, n))

    w13q, s13, b13, c13 = per_expert(q13, two_i, hidden)
    w2q, s2, b2, c2 = per_expert(q2, hidden, inter)
    return ExpertQuant(w13q, s13, w2q, s2, b13, c13, b2, c2)


def expert_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                  blocked: torch.Tensor | None = None) -> torch.Tensor:
    """linear(), with the blocked kernel where the weight is given in the blocked layout, else
    the small-batch kernel up to EXPERT_SMALL_ROWS rows of a bf16 expert."""
    if blocked is not None:
        return cpu_kernels.blocked_linear(x, blocked)
    if (len(x) <= EXPERT_SMALL_ROWS and x.dtype == weight.dtype == torch.bfloat16
            and cpu_kernels.applies(x)):
        return cpu_kernels.small_linear(x, weight)
    return linear(x, weight, packed=packed)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing,
                    packs: ExpertPacks | None = None, quant: ExpertQuant | None = None
                    ) -> torch.Tensor:
    """sum over k of weight * down(silu(gate(x)) * up(x)) per token, one matmul pair per expert
    that got tokens: w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]; with `quant`, the int8
    copies instead (layers/quant.py's int8_linear)."""
    ids, weights = routing
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order within
    counts = torch.bincount(flat, minlength=w13.shape[0])
    active = counts.nonzero().flatten()
    ends = counts.cumsum(0)[active]
    token_of = order // top_k
    xs = x.index_select(0, token_of)
    out = torch.empty(len(order), x.shape[1], dtype=x.dtype, device=x.device)
    packs = packs or ExpertPacks([], [])
    blocked = packs.blocked13 is not None
    for e, n, end in zip(active.tolist(), counts[active].tolist(), ends.tolist(), strict=True):
        rows = xs[end - n: end]
        if quant is not None:
            i13, i2 = quant.expert(e)
            out[end - n: end] = int8_linear(silu_and_mul(int8_linear(rows, i13)), i2)
            continue
        p13, p2 = (packs.w13[e], packs.w2[e]) if packs.w13 else (None, None)
        b13, b2 = (packs.blocked13[e], packs.blocked2[e]) if blocked else (None, None)
        h = silu_and_mul(expert_linear(rows, w13[e], p13, b13))
        out[end - n: end] = expert_linear(h, w2[e], p2, b2)
    out = (out * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, out)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing,
                  packs: ExpertPacks | None = None, quant: ExpertQuant | None = None
                  ) -> torch.Tensor:
    """The experts' weighted sum per token: the Triton grouped GEMM on CUDA, the C++ kernel on
    CPU for inference (grouped_experts' ops, called without Python between them and the experts
    spread over the threads), else torch; with `quant` (CPU only), the int8 copies."""
    if x.is_cuda:
        from hotswap.engine.layers import moe_triton

        return moe_triton.fused_experts(x, w13, w2, *routing)
    if cpu_kernels.applies(x) and x.dtype == w13.dtype and not torch.is_grad_enabled():
        packs = packs or ExpertPacks([], [])
        # linear()'s path past the small rows: F.linear where oneDNN does not run x's dtype (bf16
        # on a CPU without AVX-512), which also ignores any packs
        dense = ONEDNN if uses_onednn(x) else ATEN
        p13, p2 = (packs.w13, packs.w2) if dense == ONEDNN else ([], [])
        return cpu_kernels.moe_experts(x, w13, w2, p13, p2, routing.topk_ids,
                                       routing.topk_weights, EXPERT_SMALL_ROWS, dense,
                                       packs.blocked13, packs.blocked2,
                                       quant.tensors() if quant else [])
    return grouped_experts(x, w13, w2, routing, packs, quant)


class FusedMoE(nn.Module):
    """The router (`gate`) and every expert's weights, stacked: w13 [E, 2I, H] holds each
    expert's gate_proj rows then its up_proj rows (HF's fused gate_up_proj), w2 [E, H, I] its
    down_proj. Under tensor parallelism I is this rank's part of every expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, fp32_weights: bool):
        super().__init__()
        # The sizes, kept: the parameters' storage may be released (release_memory_occupation).
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.renormalize = renormalize
        self.fp32_weights = fp32_weights  # Mixtral scales in float32, Qwen3-MoE in model dtype
        # torch's own Linear, as in HF: the same logits bits, so the same experts where near-ties
        # would flip under another matmul kernel.
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Kept current by the ModelRunner, as Linear's packed and int8 copies.
        self.packs: ExpertPacks | None = None
        self.quant: ExpertQuant | None = None
        self.gate_blocked: torch.Tensor | None = None  # the router, blocked (deterministic=True)

    def pack_weights(self, enable: bool, invariant: bool = False) -> None:
        """Rebuild (or drop) the packed copies of the experts' weights: the blocked layout
        where its kernel applies, else oneDNN's where packing applies (about a fifth faster at
        the few rows an expert gets in a decode step); none beside int8 copies. `invariant`
        (deterministic=True): the router and the experts blocked, whatever the CPU (the
        portable kernel where the vector one is missing), so a token's routing and expert
        outputs never depend on the batch."""
        self.packs, self.gate_blocked = None, None
        if invariant:
            self.gate_blocked = block_pack(self.gate.weight)
            self.packs = ExpertPacks([], [], block_pack(self.w13), block_pack(self.w2))
            return
        if not enable or self.quant is not None:
            return
        if can_block(self.w13, self.w2):
            self.packs = ExpertPacks([], [], block_pack(self.w13), block_pack(self.w2))
        elif can_pack(self.w13[0]):
            self.packs = ExpertPacks([pack(w) for w in self.w13], [pack(w) for w in self.w2])

    def quantize(self, enable: bool) -> int:
        """Rebuild (or drop) the experts' int8 copies (the router stays in the model's dtype);
        returns their bytes."""
        self.quant = (quantize_experts(self.w13.detach(), self.w2.detach(), self.quant)
                      if enable else None)
        return self.quant.nbytes if self.quant is not None else 0

    def route(self, x: torch.Tensor, topk_ids: torch.Tensor | None = None) -> Routing:
        weights_dtype = torch.float32 if self.fp32_weights else x.dtype
        logits = (self.gate(x) if self.gate_blocked is None else
                  cpu_kernels.blocked_linear(x, self.gate_blocked, outputs=self.num_experts))
        return select_experts(logits, self.top_k, self.renormalize, weights_dtype, topk_ids)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor | None = None) -> MoEOutput:
        """x [tokens, hidden]; `topk_ids` [tokens, top_k] replays a recorded routing."""
        if topk_ids is not None and tuple(topk_ids.shape) != (len(x), self.top_k):
            raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)}, expected "
                             f"{(len(x), self.top_k)}")
        routing = self.route(x, topk_ids)
        return MoEOutput(fused_experts(x, self.w13, self.w2, routing, self.packs, self.quant),
                         routing.topk_ids)
