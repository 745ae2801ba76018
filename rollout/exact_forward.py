"""The exact trainer forward: per-token logprobs of a Hugging Face causal LM, differentiable, whose
bits equal what a deterministic=True engine returned for the same tokens under the same weights.

An engine with deterministic=True computes every token with batch-invariant CPU kernels (the
blocked matmul, per-row RMSNorm, rotary, SiLU-and-multiply, per-query attention, the invariant
head and the sampler's log-sum-exp): a token's bits depend on its own sequence only, never on
its batch-mates, the prefill chunking or the prefix cache. This forward runs those same kernels
over the trainer's batch, reading the HF model's parameters as they are (each matmul weight is
reordered into the kernel's blocked layout for the call and dropped), so the trainer's logprob
of a sampled token equals the engine's bit for bit: the PPO/GRPO importance ratio is exactly 1
on-policy and no mismatch correction is needed. Each op is a torch.autograd.Function whose
forward is the kernel and whose backward is ordinary torch math (the attention, norms and
experts recomputed), so gradients are the HF model's up to float32 rounding.

Families: Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norms), Qwen3-MoE and Mixtral (transformers 5's
stacked experts); float32 and bf16; on the CPU with hotswap's kernels built. MoE routing is
computed with the engine's own router arithmetic, so the experts match by construction and
routing replay is unnecessary. Logprobs equal the engine's processed logprobs for temperature
sampling without top-k/top-p/min-p (or its raw ones at temperature 1).
docs/rl.md#the-exact-trainer-forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hotswap.engine.config import ModelConfig
from hotswap.engine.layers import cpu_kernels
from hotswap.engine.layers.moe import select_experts
from hotswap.engine.layers.rotary import RotaryEmbedding
from hotswap.engine.models.llama import InvariantHead, invariant_logits

MIXTRAL = "MixtralForCausalLM"


class Sequences(NamedTuple):
    """A batch's tokens flat, and which earlier tokens each attends to: token i sits at position
    positions[i] and sees the keys table[row[i], :positions[i] + 1] (flat token indices, in
    order; its own last). The engine's req_to_token table, with tokens for KV slots."""

    ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    table: torch.Tensor  # [R, W] int64
    row: torch.Tensor  # [N] int64


def padded_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                     ) -> tuple[Sequences, torch.Tensor]:
    """A padded batch [B, T] (left or right padding, attention_mask 1 on tokens) as Sequences,
    and the flat index of every (b, t) [B, T] (-1 on padding)."""
    mask = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
            else attention_mask.bool())
    index = torch.full(input_ids.shape, -1, dtype=torch.long)
    index[mask] = torch.arange(int(mask.sum()))
    positions = (mask.long().cumsum(1) - 1)[mask]
    rows = torch.arange(len(input_ids))[:, None].expand_as(input_ids)[mask]
    width = int(mask.sum(1).max())
    table = torch.zeros(len(input_ids), width, dtype=torch.long)
    table[rows, positions] = torch.arange(len(positions))
    return Sequences(input_ids[mask], positions, table, rows), index


def packed_sequences(input_ids: torch.Tensor, position_ids: torch.Tensor) -> Sequences:
    """Sequences packed one after another (verl's and TRL's padding-free layout): input_ids and
    position_ids [N] or [1, N], a sequence starting wherever its position is 0."""
    ids, positions = input_ids.reshape(-1), position_ids.reshape(-1).long()
    starts = (positions == 0).nonzero().flatten()
    if not len(starts) or starts[0] != 0:
        raise ValueError("packed position_ids must start each sequence at 0")
    lengths = torch.diff(starts, append=torch.tensor([len(ids)]))
    if not torch.equal(positions, torch.arange(len(ids)) - starts.repeat_interleave(lengths)):
        raise ValueError("packed position_ids must count 0, 1, 2, ... within each sequence")
    rows = torch.arange(len(starts)).repeat_interleave(lengths)
    table = torch.zeros(len(starts), int(lengths.max()), dtype=torch.long)
    table[rows, positions] = torch.arange(len(ids))
    return Sequences(ids, positions, table, rows)


def segment_sequences(input_ids: torch.Tensor, position_ids: torch.Tensor,
                      segments: torch.Tensor) -> tuple[Sequences, torch.Tensor]:
    """The GRPO trainer's packed units (rollout/trainer.py's pack): per unit [U, L] a prompt
    (segment 0) then responses (segments 1, 2, ...) that each see the prompt and themselves,
    -1 padding. Returns the Sequences (a table row per response: the prompt's tokens, then its
    own) and the flat index of every (unit, column) [U, L] (-1 on padding)."""
    valid = segments >= 0
    index = torch.full(segments.shape, -1, dtype=torch.long)
    index[valid] = torch.arange(int(valid.sum()))
    keys: list[torch.Tensor] = []
    row_of = torch.empty(int(valid.sum()), dtype=torch.long)
    for seg, idx in zip(segments, index, strict=True):
        prompt, first = idx[seg == 0], len(keys)
        for k in torch.unique(seg[seg > 0]).tolist():
            mine = idx[seg == k]
            row_of[mine] = len(keys)
            keys.append(torch.cat((prompt, mine)))
        if len(keys) == first:  # a unit without responses: the prompt alone
            keys.append(prompt)
        row_of[prompt] = first  # the prompt's tokens read the prefix of the unit's first row
    table = torch.zeros(len(keys), max(len(k) for k in keys), dtype=torch.long)
    for r, k in enumerate(keys):
        table[r, :len(k)] = k
    return Sequences(input_ids[valid], position_ids[valid].long(), table, row_of), index


# The autograd functions: forward the engine's kernel, backward torch math.

class _Linear(torch.autograd.Function):
    """x @ w.T (+ bias) (+ residual): blocked_linear (sums in k order, one rounding)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual):
        ctx.save_for_backward(x, weight)
        ctx.flags = bias is not None, residual is not None
        return cpu_kernels.blocked_linear(x, cpu_kernels.block_pack(weight), bias, residual,
                                          outputs=weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        has_bias, has_residual = ctx.flags
        return (g.mm(weight), g.t().mm(x), g.sum(0) if has_bias else None,
                g if has_residual else None)


def _recompute(fn, inputs, g):
    """Gradients of fn(*inputs) against g, by autograd over torch ops in the inputs' dtype
    (fn upcasts where it needs float32, as HF's backward does); None where none is needed."""
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    with torch.enable_grad():
        out = fn(*leaves)
    wanted = [t for t in leaves if t.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, g.to(out.dtype)) if wanted else [])
    return [next(grads) if t.requires_grad else None for t in inputs]


def _rms(x, w, eps):
    """RMSNorm in float32 (the kernel's arithmetic), in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return cpu_kernels.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        return (*_recompute(lambda a, b: _rms(a, b, ctx.eps).to(a.dtype), (x, weight), g),
                None)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return cpu_kernels.silu_and_mul(gate_up)

    @staticmethod
    def backward(ctx, g):
        (gate_up,) = ctx.saved_tensors

        def fn(t):
            gate, up = t.float().chunk(2, dim=-1)
            return (F.silu(gate) * up).to(t.dtype)
        return tuple(_recompute(fn, (gate_up,), g))


class _Rotary(torch.autograd.Function):
    """x [N, H, D] rotated (half-rotation layout) by float32 cos, sin [N, D/2]."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return cpu_kernels.rotary_(x.clone(), cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = (t[:, None, :] for t in ctx.saved_tensors)
        g1, g2 = g.float().chunk(2, dim=-1)
        return torch.cat((g1 * cos + g2 * sin, g2 * cos - g1 * sin), -1).to(g.dtype), None, None


def _attention_math(q, k, v, seqs: Sequences, scale: float):
    """The attention of every token over its keys in torch ops (float32): q [N, Hq, D], k and
    v [N, Hkv, D] -> [N, Hq * D]. Queries grouped by table row, padded to the longest group."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    order = torch.argsort(seqs.row, stable=True)
    counts = torch.bincount(seqs.row, minlength=len(seqs.table))
    starts = counts.cumsum(0) - counts
    lq = int(counts.max())
    slot = torch.arange(lq)[None, :]
    valid = slot < counts[:, None]  # [R, Lq]
    qidx = order[(starts[:, None] + slot).clamp(max=n - 1)]  # [R, Lq]; past a row's count:
    # another row's queries, computed and dropped
    keys = k[seqs.table].repeat_interleave(group, dim=2)  # [R, W, Hq, D]
    values = v[seqs.table].repeat_interleave(group, dim=2)
    scores = torch.einsum("rqhd,rkhd->rhqk", q[qidx], keys) * scale
    seen = torch.arange(seqs.table.shape[1])[None, None, :] <= seqs.positions[qidx][:, :, None]
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
    out = torch.einsum("rhqk,rkhd->rqhd", probs, values)
    flat = torch.empty(n, hq, d, dtype=out.dtype)
    return flat.index_put((qidx[valid],), out[valid]).reshape(n, hq * d)


class _Attention(torch.autograd.Function):
    """Per-query attention: the engine's paged kernel over the batch's own K/V as the pool."""

    @staticmethod
    def forward(ctx, q, k, v, seqs, scale):
        ctx.save_for_backward(q, k, v)
        ctx.seqs, ctx.scale = seqs, scale
        return cpu_kernels.decode_attention(q.reshape(len(q), -1), k, v, seqs.table, seqs.row,
                                            seqs.positions + 1, scale)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        grads = _recompute(lambda a, b, c: _attention_math(a, b, c, ctx.seqs, ctx.scale),
                           (q, k, v), g)
        return (*grads, None, None)


class _Head(torch.autograd.Function):
    """Float32 logits of the last hidden states: the engine's invariant_logits."""

    @staticmethod
    def forward(ctx, hidden, norm_weight, weight, eps):
        ctx.save_for_backward(hidden, norm_weight, weight)
        ctx.eps = eps
        return invariant_logits(hidden, InvariantHead.of(norm_weight, weight), eps)

    @staticmethod
    def backward(ctx, g):
        """The float32 norm recomputed; the lm_head's two matmuls in the weight's dtype (as
        HF's backward runs them)."""
        hidden, norm_weight, weight = ctx.saved_tensors
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(hidden.requires_grad)
            n = norm_weight.detach().requires_grad_(norm_weight.requires_grad)
            normed = _rms(h, n, ctx.eps)
        g = g.to(weight.dtype)
        grad_weight = g.t().mm(normed.detach().to(weight.dtype)) if weight.requires_grad else None
        wanted = [t for t in (h, n) if t.requires_grad]
        grads = iter(torch.autograd.grad(normed, wanted, g.mm(weight).float()) if wanted else [])
        return (next(grads).to(hidden.dtype) if h.requires_grad else None,
                next(grads).to(norm_weight.dtype) if n.requires_grad else None, grad_weight,
                None)


class _TokenLogprob(torch.autograd.Function):
    """log softmax(x)[target] from the sampler's kernel log-sum-exp (float64), as the engine
    returns it; x the logits already divided by the temperature."""

    @staticmethod
    def forward(ctx, x, target):
        ctx.save_for_backward(x, target)
        lse = cpu_kernels.sample_rows(x.contiguous(), None)[1]
        return (x.gather(1, target[:, None])[:, 0].double() - lse).float()

    @staticmethod
    def backward(ctx, g):
        x, target = ctx.saved_tensors
        grad = -torch.softmax(x, -1)
        grad.scatter_add_(1, target[:, None], torch.ones_like(target, dtype=grad.dtype)[:, None])
        return grad * g[:, None], None


class _Experts(torch.autograd.Function):
    """An MoE layer's weighted expert outputs: the engine's moe_experts kernel over the blocked
    experts (each token's outputs summed in ascending expert order)."""

    @staticmethod
    def forward(ctx, x, w13, w2, weights, ids):
        ctx.save_for_backward(x, w13, w2, weights, ids)
        return cpu_kernels.moe_experts(x, w13.contiguous(), w2.contiguous(), [], [], ids, weights,
                                       0, 0, cpu_kernels.block_pack(w13),
                                       cpu_kernels.block_pack(w2), [])

    @staticmethod
    def backward(ctx, g):
        x, w13, w2, weights, ids = ctx.saved_tensors
        top_k, inter = ids.shape[1], w2.shape[2]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=w13.shape[0])
        token_of = order // top_k

        def fn(x, w13, w2, weights):  # in the model's dtype, as HF's experts
            xs, outs, start = x[token_of], [], 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    rows = xs[start: start + n]
                    h = F.silu(rows @ w13[e, :inter].t()) * (rows @ w13[e, inter:].t())
                    outs.append(h @ w2[e].t())
                    start += n
            pairs = (torch.cat(outs) * weights.reshape(-1)[order, None]).to(x.dtype)
            return torch.zeros_like(x).index_add(0, token_of, pairs)
        return (*_recompute(fn, (x, w13, w2, weights), g), None)


class ExactForward:
    """The exact forward of one HF causal LM (module docstring); holds no copy of its weights.

        exact = ExactForward(model)
        logp = exact(input_ids, attention_mask)   # [B, T]: log p(ids[:, t] | ids[:, :t])
        logp = exact.packed(input_ids, position_ids)   # [N]: log p(next token), padding-free
    """

    def __init__(self, model: torch.nn.Module):
        if not cpu_kernels.available():
            raise RuntimeError("the exact forward needs hotswap's CPU kernels (a C++ compiler; "
                               "see docs/cpu.md)")
        if model.device.type != "cpu" or model.dtype not in cpu_kernels.DTYPES:
            raise ValueError(f"the exact forward runs float32 or bf16 models on the CPU, got "
                             f"{model.dtype} on {model.device}")
        config = model.config.to_dict()
        if not config.get("architectures"):
            config["architectures"] = [type(model).__name__]
        self.model, self.cfg = model, ModelConfig.from_dict(config)
        self.decoder = model.get_decoder()
        if self.cfg.num_experts and not hasattr(self._moe_blocks()[0].experts, "gate_up_proj"):
            raise ValueError("the exact forward reads stacked experts (transformers >= 5)")
        self.rotary = RotaryEmbedding(self.cfg.head_dim, self.cfg.max_position_embeddings,
                                      self.cfg.rope_theta, self.cfg.rope_scaling)

    def _moe_blocks(self) -> list[torch.nn.Module]:
        return [layer.mlp for layer in self.decoder.layers if hasattr(layer.mlp, "experts")]

    def hidden(self, seqs: Sequences, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The last decoder layer's output [N, hidden] (before the final norm); `routes`, when
        given, gets each MoE layer's experts [N, top_k]."""
        cfg = self.cfg
        x = self.decoder.embed_tokens(seqs.ids)
        cos, sin = self.rotary.cos[seqs.positions], self.rotary.sin[seqs.positions]
        n, scale = len(seqs.ids), cfg.head_dim ** -0.5
        for layer in self.decoder.layers:
            attn = layer.self_attn
            h = _RMSNorm.apply(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
            q, k, v = (_Linear.apply(h, p.weight, p.bias, None)
                       for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            q = q.view(n, cfg.num_heads, cfg.head_dim)
            k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = _RMSNorm.apply(q.reshape(-1, cfg.head_dim), attn.q_norm.weight,
                                   cfg.rms_norm_eps).view(q.shape)
                k = _RMSNorm.apply(k.reshape(-1, cfg.head_dim), attn.k_norm.weight,
                                   cfg.rms_norm_eps).view(k.shape)
            q, k = _Rotary.apply(q, cos, sin), _Rotary.apply(k, cos, sin)
            o = _Attention.apply(q, k, v.view(n, cfg.num_kv_heads, cfg.head_dim), seqs, scale)
            x = _Linear.apply(o, attn.o_proj.weight, None, x)
            h = _RMSNorm.apply(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            x = self._mlp(layer.mlp, h, x, routes)
        return x

    def _mlp(self, mlp: torch.nn.Module, h: torch.Tensor, residual: torch.Tensor,
             routes: list[torch.Tensor] | None) -> torch.Tensor:
        if not hasattr(mlp, "experts"):
            gate_up = torch.cat((_Linear.apply(h, mlp.gate_proj.weight, None, None),
                                 _Linear.apply(h, mlp.up_proj.weight, None, None)), -1)
            return _Linear.apply(_SiluMul.apply(gate_up), mlp.down_proj.weight, None, residual)
        cfg, experts = self.cfg, mlp.experts
        logits = _Linear.apply(h, mlp.gate.weight, None, None)
        mixtral = cfg.architecture == MIXTRAL
        routing = select_experts(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                 torch.float32 if mixtral else h.dtype)
        if routes is not None:
            routes.append(routing.topk_ids)
        out = _Experts.apply(h, experts.gate_up_proj, experts.down_proj, routing.topk_weights,
                             routing.topk_ids)
        return out + residual

    def logprobs(self, seqs: Sequences, source: torch.Tensor, target: torch.Tensor,
                 temperature: float = 1.0, routes: list[torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """[len(source)] log p(target[j] | the tokens up to flat token source[j]) at
        `temperature`, the head and the log-softmax on those positions only."""
        return self.head_logprobs(self.hidden(seqs, routes)[source], target, temperature)

    def head_logprobs(self, hidden: torch.Tensor, target: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
        """log p(target[j]) from the last hidden states [M, hidden] of the predicting tokens."""
        logits = _Head.apply(hidden, self.decoder.norm.weight,
                             self.model.get_output_embeddings().weight, self.cfg.rms_norm_eps)
        if temperature > 0 and temperature != 1.0:  # as the sampler divides: by a tensor
            logits = logits / torch.full((len(logits), 1), temperature, dtype=logits.dtype)
        return _TokenLogprob.apply(logits, target)

    def packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
        """Padding-free sequences (input_ids, position_ids [1, N] or [N], verl's remove-padding
        layout) -> [N]: log p(the next token of the same sequence | up to this one), 0 at each
        sequence's last token (what verl's rolled labels leave to its response mask)."""
        seqs = packed_sequences(input_ids, position_ids)
        nxt = torch.arange(1, len(seqs.ids))
        scored = torch.cat((seqs.positions[1:] > 0, torch.tensor([False])))
        flat = self.logprobs(seqs, scored.nonzero().flatten(), seqs.ids[nxt[scored[:-1]]],
                             temperature)
        out = torch.zeros(len(seqs.ids), dtype=flat.dtype)
        return out.index_put((scored,), flat)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
        """A padded batch [B, T] -> [B, T]: log p(input_ids[b, t] | its sequence before t), 0 at
        each sequence's first token and on padding."""
        seqs, index = padded_sequences(input_ids, attention_mask)
        prev = torch.full_like(index, -1)  # the flat token before each, -1 before a first
        prev[:, 1:] = index[:, :-1]
        scored = (index >= 0) & (prev >= 0)
        flat = self.logprobs(seqs, prev[scored], input_ids[scored], temperature)
        out = torch.zeros(input_ids.shape, dtype=flat.dtype)
        return out.index_put((scored.nonzero(as_tuple=True)), flat)
