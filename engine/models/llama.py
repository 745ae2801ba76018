"""Llama-family decoder (Llama, SmolLM2, Qwen2 with q/k/v bias, Qwen3 with q/k RMSNorm).

q/k/v and gate/up are fused into one parameter each; `hf_weight_map` tells the loader and the
weight-update path which slice of which parameter every Hugging Face checkpoint name lands in.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from hotswap.engine.attention.base import FusedDecodeInputs
from hotswap.engine.config import ModelConfig
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.cpu_features import read_cpu_flags
from hotswap.engine.layers import cpu_kernels
from hotswap.engine.layers.activation import silu_and_mul
from hotswap.engine.layers.linear import (
    AMX,
    AMX_ROWS,
    ONEDNN,
    SMALL_ROWS,
    Linear,
    amx_packs,
    blocks_by_default,
    can_block,
    is_amx_pack,
    linear,
    matmul_path,
    pack,
    quantize_model,
)
from hotswap.engine.layers.norm import RMSNorm, rms_norm
from hotswap.engine.layers.quant import QuantWeight
from hotswap.engine.layers.rotary import RotaryEmbedding, apply_rotary

# The float32 lm_head of a bf16 model at a decode step of few rows reads the bf16 weights (half
# the bytes of a float32 copy, the same products). With AVX512-BF16, up to SMALL_HEAD_ROWS rows,
# in small_linear's matrix-vector loop; on AMX more rows take cpu_kernels.head_logits. Elsewhere
# (and above SMALL_HEAD_ROWS without AMX) up to SPLIT_HEAD_ROWS rows the blocked bf16 weights
# times the two bf16 halves of x (invariant_logits), more rows the blocked float32 copy.
# SmolLM2's head from DRAM, ms, small_linear / split / float32 copy blocked: AVX512-BF16 1 row
# 2.11 / 2.35 / 3.76, 6 rows 2.48 / 2.51 / 4.06, 8 rows 4.39 / 3.21 / 4.04, 16 rows - / 5.92 /
# 5.61; AVX2 switch 1 row 5.52 / 3.51 / 5.69, 4 rows - / 5.18 / 5.85, 8 rows - / 9.41 / 6.76
# (docs/performance.md#the-blocked-matmul-by-default). A learned draft's head (models/draft.py)
# takes small_linear up to SMALL_HEAD_ROWS rows too.
NATIVE_BF16 = "avx512_bf16" in read_cpu_flags()
SMALL_HEAD_ROWS = 6 if NATIVE_BF16 else 2
SPLIT_HEAD_ROWS = 8 if NATIVE_BF16 else 4


class WeightSlot(NamedTuple):
    """Rows [start, end) of `param` (of `param[expert]` for one expert of a stacked MoE
    parameter) hold one HF tensor. An alias (`covers` not empty) is another checkpoint naming of
    the storage that the names in `covers` hold: it may replace them in a checkpoint or update,
    and it is never required itself."""

    param: torch.Tensor
    start: int
    end: int
    expert: int | None = None
    covers: tuple[str, ...] = ()

    @property
    def view(self) -> torch.Tensor:
        data = self.param.data if self.expert is None else self.param.data[self.expert]
        return data[self.start: self.end]


def whole(param: torch.Tensor) -> WeightSlot:
    return WeightSlot(param, 0, param.shape[0])


def split(prefix: str, param: torch.Tensor, parts: list[tuple[str, int]], kind: str
          ) -> dict[str, WeightSlot]:
    """`{prefix}.{part}.{kind}` -> consecutive row blocks of param, one per (part, size)."""
    out, start = {}, 0
    for part, size in parts:
        out[f"{prefix}.{part}.{kind}"] = WeightSlot(param, start, start + size)
        start += size
    return out


class InvariantHead(NamedTuple):
    """What the batch-invariant logits read (deterministic=True; a float32 model's by default):
    the final norm's weight in float32 and the lm_head in cpu_kernels' blocked layout."""

    norm_weight: torch.Tensor
    blocked: torch.Tensor  # block_pack pads the vocabulary to whole blocks of 32
    vocab: int

    @classmethod
    def of(cls, norm_weight: torch.Tensor, head: torch.Tensor) -> InvariantHead:
        """The head [vocab, k] blocked, beside the norm's weight in float32."""
        return cls(norm_weight.detach().float(), cpu_kernels.block_pack(head.detach()),
                   head.shape[0])


class Fp32Head(NamedTuple):
    """What the float32 final norm and lm_head of a bf16/fp16 model read: float32 copies of
    both weights; on AMX the bf16 lm_head packed for cpu_kernels.head_logits instead; with the
    blocked matmul (layers/linear.py) the bf16 lm_head and its float32 copy, both blocked."""

    norm_weight: torch.Tensor
    weight: torch.Tensor | None  # the packed copy itself when packing applies (saves a copy)
    packed: torch.Tensor | None
    amx: torch.Tensor | None = None  # head_pack(bf16 lm_head); then weight and packed are None
    split: InvariantHead | None = None  # up to SPLIT_HEAD_ROWS rows: the bf16 lm_head blocked
    wide: InvariantHead | None = None  # more rows: its float32 copy blocked


def invariant_logits(hidden: torch.Tensor, head: InvariantHead, eps: float) -> torch.Tensor:
    """Float32 logits [m, vocab] of hidden states [m, k] whose bits never depend on the other
    rows: the final RMSNorm in float32, then blocked_linear's in-order float32 sums. A bf16
    model's normed state x is split into two bf16 parts, hi = bf16(x) and lo = bf16(x - hi),
    multiplied as 2m rows and summed, hi + lo: float32 products of the bf16 weights to ~2^-17 of
    x, as the float32 head of the default mode has (build_fp32_head). The trainer's exact forward
    (rollout/exact_forward.py) calls this same function."""
    x = rms_norm(hidden.float(), head.norm_weight, eps)
    if head.blocked.dtype == torch.float32:
        return cpu_kernels.blocked_linear(x, head.blocked, float_out=True, outputs=head.vocab)
    hi = x.to(head.blocked.dtype)
    lo = (x - hi.float()).to(head.blocked.dtype)
    sums = cpu_kernels.blocked_linear(torch.cat((hi, lo)), head.blocked, float_out=True,
                                      outputs=head.vocab)
    return sums[: len(x)] + sums[len(x):]


def _project(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + proj(x): the add fused into the matmul where proj is a plain Linear (a
    tensor-parallel wrapper all-reduces first, so it adds afterwards)."""
    if isinstance(proj, Linear):
        return proj(x, residual)
    out = proj(x)
    return out if residual is None else out + residual


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, residual: torch.Tensor
                ) -> torch.Tensor:
        """residual + attention(x)."""
        cfg = self.cfg
        qkv = self.qkv_proj(x)
        if fb.lora is not None:
            fb.lora.apply(self.layer_id, "qkv", x, qkv)
        heads = cfg.num_heads + cfg.num_kv_heads
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(-1, heads, cfg.head_dim)
        if cfg.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, : cfg.num_heads]),
                            self.k_norm(qk[:, cfg.num_heads:])), dim=1)
        # q and k are adjacent in the fused output: one rotation covers both.
        qk = apply_rotary(qk, fb.rope).view(-1, heads * cfg.head_dim)
        q, k = qk.split([cfg.q_size, cfg.kv_size], dim=-1)
        v = qkv[:, cfg.q_size + cfg.kv_size:]
        o = fb.attn_backend.forward(q, k, v, self.layer_id, fb)
        out = _project(self.o_proj, o, residual)
        return out if fb.lora is None else fb.lora.apply(self.layer_id, "o", o, out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fb: ForwardBatch | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """(residual +) mlp(x)."""
        lora = fb.lora if fb is not None else None
        if lora is None:
            h = self.gate_up_proj.silu_and_mul(x)
        else:
            gate_up = self.gate_up_proj(x)
            lora.apply(self.layer_id, "gate_up", x, gate_up)
            h = silu_and_mul(gate_up)
        out = _project(self.down_proj, h, residual)
        return out if lora is None else lora.apply(self.layer_id, "down", h, out)

    def hf_weights(self, layer_prefix: str) -> dict[str, WeightSlot]:
        """This MLP's HF names (under `model.layers.{i}`) and where they land."""
        gate_up = [("gate_proj", self.intermediate), ("up_proj", self.intermediate)]
        return {**split(f"{layer_prefix}.mlp", self.gate_up_proj.weight, gate_up, "weight"),
                f"{layer_prefix}.mlp.down_proj.weight": whole(self.down_proj.weight)}


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.mlp = LlamaMLP(cfg, layer_id) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), fb, residual=x)
        return self.mlp(self.post_attention_layernorm(x), fb, residual=x)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, self.make_mlp(cfg, i))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # _forward_fused's layers by (at most SMALL_ROWS rows, at most AMX_ROWS, dtype, layer
        # count), built on first use: they hold the weights and packed copies, so
        # LlamaForCausalLM.pack_weights (called whenever the weights change) clears them.
        self.fused_layers: dict[tuple[bool, bool, torch.dtype, int], torch.ScriptObject] = {}

    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        """Layer layer_id's MLP (a subclass's hook: MoE models put experts here)."""
        return LlamaMLP(cfg, layer_id)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(fb.input_ids)
        fb.rope = self.rotary.lookup(fb.positions, x.dtype)
        count = len(self.layers) if fb.num_layers is None else fb.num_layers
        step = self._fused_decode_inputs(fb)
        if step is not None:
            return self._forward_fused(x, fb, step, count)
        for layer in self.layers[:count]:
            x = layer(x, fb)
        return x

    def _forward_fused(self, x: torch.Tensor, fb: ForwardBatch, step: FusedDecodeInputs,
                       count: int) -> torch.Tensor:
        """The first `count` layers' forward() for a decode-only CPU step in one kernel call:
        the same ops, without ~20 Python-dispatched ones per layer."""
        key = (len(x) <= SMALL_ROWS, len(x) <= AMX_ROWS, x.dtype, count)
        layers = self.fused_layers.get(key)
        if layers is None:
            layers = self.fused_layers[key] = self._build_fused_layers(x, count)
        return cpu_kernels.decode_layers(
            x, layers, step.k_buffers[:count], step.v_buffers[:count], fb.rope.cos, fb.rope.sin,
            step.out_cache_loc, step.req_to_token, step.req_idx, step.seq_lens, step.scale)

    def _build_fused_layers(self, x: torch.Tensor, count: int) -> torch.ScriptObject:
        """The first `count` layers' weights for steps like x, as linear() multiplies them on
        the path it takes for such steps."""
        attn = self.layers[0].self_attn
        path = matmul_path(x, attn.qkv_proj.weight, attn.qkv_proj.bias, x,  # x: the residual
                           attn.qkv_proj.quant, attn.qkv_proj.blocked, attn.qkv_proj.packed)
        if path == AMX and not all(  # one path for the stack: AMX only where every weight can
                is_amx_pack(p.packed) for layer in self.layers[:count]
                for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                          layer.mlp.gate_up_proj, layer.mlp.down_proj)):
            path = ONEDNN

        def layer_weights(layer: LlamaDecoderLayer) -> cpu_kernels.LayerWeights:
            attn, mlp = layer.self_attn, layer.mlp
            (qkv, qkv_quant), (o, o_quant), (gate_up, gate_up_quant), (down, down_quant) = (
                p.fused_weights(path)
                for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            return cpu_kernels.LayerWeights(
                layer.input_layernorm.weight, qkv, attn.qkv_proj.bias, o,
                layer.post_attention_layernorm.weight, gate_up, down,
                qkv_quant, o_quant, gate_up_quant, down_quant)

        return cpu_kernels.decode_stack(map(layer_weights, self.layers[:count]),
                                        self.cfg.rms_norm_eps,
                                        path, self.cfg.num_heads)

    def _fused_decode_inputs(self, fb: ForwardBatch) -> FusedDecodeInputs | None:
        """The step's inputs to the fused CPU decoder layer, or None where the layers run op by
        op: not a decode-only CPU step, adapters in the batch, q/k norms, or tensor-parallel
        projections."""
        attn = self.layers[0].self_attn
        mlp = self.layers[0].mlp
        if not fb.rope.fused or fb.lora is not None or attn.cfg.qk_norm or not all(
                isinstance(p, Linear) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                 mlp.down_proj)):
            return None
        return fb.attn_backend.fused_decode_inputs(fb)


class LlamaForCausalLM(nn.Module):
    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.model = self.model_class(cfg, max_positions)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_quant: QuantWeight | None = None  # int8 lm_head (layers/quant.py)
        self.fp32_head: Fp32Head | None = None
        # deterministic=True's, and a float32 model's by default (pack_weights)
        self.blocked_head: InvariantHead | None = None
        # The memory of the layers' blocked copies (by dtype), their AMX copies ("amx") and the
        # AMX head's ("head"), in huge pages: kept across weight updates (cpu_kernels.
        # side_by_side), freed with the weights (ModelRunner.release_weights).
        self.pack_regions: dict[torch.dtype | str, torch.Tensor] = {}
        self.draft: nn.Module | None = None  # a learned draft's DraftModel (models/draft.py)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 logits [len(fb.logits_indices), vocab] for the rows that sample."""
        hidden = self.model(fb)
        if fb.features is not None:  # a learned draft reads every position's normed state
            fb.features.index_copy_(0, fb.out_cache_loc, self.model.norm(hidden))
        return self.logits(hidden[fb.logits_indices])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.blocked_head is not None:
            return invariant_logits(hidden, self.blocked_head, self.cfg.rms_norm_eps)
        if self.lm_head_quant is not None:  # float32 norm, int8 matmul, float32 logits
            x = rms_norm(hidden.float(), self.model.norm.weight.float(), self.cfg.rms_norm_eps)
            return linear(x, self.lm_head_weight, quant=self.lm_head_quant)
        head = self.fp32_head
        if head is None:
            return linear(self.model.norm(hidden), self.lm_head_weight,
                          packed=self.lm_head_packed).float()
        # A bf16/fp16 model: final norm and lm_head in float32.
        rows = len(hidden)
        if head.split is not None and (rows > SMALL_HEAD_ROWS or not NATIVE_BF16):
            return invariant_logits(hidden, head.split if rows <= SPLIT_HEAD_ROWS else head.wide,
                                    self.cfg.rms_norm_eps)
        weight = self.lm_head_weight
        if rows > SMALL_HEAD_ROWS and head.amx is not None:
            return cpu_kernels.head_logits(hidden, self.model.norm.weight, self.cfg.rms_norm_eps,
                                           head.amx, weight.shape[0])
        x = rms_norm(hidden.float(), head.norm_weight, self.cfg.rms_norm_eps)
        if (len(x) <= SMALL_HEAD_ROWS and weight.dtype == torch.bfloat16
                and cpu_kernels.applies(weight)):
            return cpu_kernels.small_linear(x, weight)
        return linear(x, head.weight, packed=head.packed)

    def build_fp32_head(self, enable: bool, packed: bool) -> None:
        """Rebuild (or drop) the float32 copies of the final norm and lm_head weights.

        A cache of the weights, like the packed copies: in a bf16 model the logits (and so the
        logprobs RL trains on) then carry only the error of the bf16 hidden state, not that of
        bf16 logits (an ulp of a logit near 20 is 0.125)."""
        if not enable or self.lm_head_weight.dtype == torch.float32:
            self.fp32_head = None
            return
        norm, head = self.model.norm.weight.detach(), self.lm_head_weight.detach()
        if (head.dtype == norm.dtype == torch.bfloat16 and cpu_kernels.applies(head)
                and cpu_kernels.amx()):
            # No float32 copy: AMX multiplies the bf16 weight by an exact split (float32 products).
            amx = cpu_kernels.side_by_side([head], [cpu_kernels.amx_shape(head)],
                                           cpu_kernels.head_pack, self.pack_regions, "head")[0]
            self.fp32_head = Fp32Head(norm.float(), None, None, amx)
            return
        if packed and head.dtype == torch.bfloat16 and blocks_by_default(head, pad=True):
            split = InvariantHead.of(norm, head)
            self.fp32_head = Fp32Head(
                split.norm_weight, None, None, split=split,
                wide=split._replace(blocked=cpu_kernels.widen_blocked(split.blocked)))
            return
        weight = head.float()
        pk = pack(weight) if packed else None
        self.fp32_head = Fp32Head(norm.float(), weight if pk is None else pk, pk)

    def quantize_weights(self, enable: bool, head: bool = False) -> int:
        """Rebuild (or drop) the int8 copies of the weights (layers/linear.py's quantize_model);
        returns their bytes. Called before pack_weights, which packs nothing that has one."""
        return quantize_model(self, enable, head)

    def pack_weights(self, enable: bool = True, invariant: bool = False) -> None:
        """Rebuild (or drop) the packed copy of every matmul weight (layers/linear.py: blocked
        where the default takes the blocked matmul, else oneDNN's) and drop the fused layers
        built from the old ones; with `invariant` (deterministic=True) the blocked copies and
        the blocked head, whatever the dtype and the CPU."""
        self.model.fused_layers.clear()
        blocked_modules, amx_modules = [], []
        for module in self.modules():
            if isinstance(module, Linear) and module is not getattr(self, "lm_head", None):
                # An int8 copy (layers/quant.py, built first) is multiplied instead.
                plain = enable and module.quant is None
                blocked = invariant or (plain and blocks_by_default(module.weight))
                module.blocked = module.packed = None  # the new copies are set below
                if blocked:
                    blocked_modules.append(module)
                elif plain and amx_packs(module.weight):
                    amx_modules.append(module)
                elif plain:
                    module.packed = pack(module.weight)
        # In the order a decode step reads them, in the huge pages of the last update's copies.
        packs = cpu_kernels.block_pack_all([m.weight for m in blocked_modules], self.pack_regions)
        for module, packed in zip(blocked_modules, packs):
            module.blocked = packed
        packs = cpu_kernels.amx_pack_all([m.weight.detach() for m in amx_modules],
                                         self.pack_regions)
        for module, packed in zip(amx_modules, packs):
            module.packed = packed
        # With the float32 head (built first) the model-dtype lm_head is never multiplied.
        head = self.lm_head_weight
        plain = enable and self.fp32_head is None and self.lm_head_quant is None
        blocked = invariant or (plain and head.dtype == torch.float32
                                and blocks_by_default(head, pad=True))
        self.lm_head_packed = pack(head) if plain and not blocked else None
        self.blocked_head = InvariantHead.of(self.model.norm.weight, head) if blocked else None
        if self.draft is not None:
            self.draft.derive(self.lm_head_weight)

    def unblockable(self) -> list[str]:
        """The matmul weights that do not fit the blocked layout (layers/linear.py's can_block),
        by name: deterministic=True refuses such a model. (The lm_head and MoE routers are
        padded to whole blocks instead: their outputs are not added to a residual.)"""
        return [name for name, p in self.named_parameters()
                if name.endswith(("proj.weight", ".w13", ".w2"))
                and not all(can_block(w) for w in (p.unsqueeze(0) if p.dim() == 2 else p))]

    def hf_weight_map(self) -> dict[str, WeightSlot]:
        """Every HF checkpoint name this model takes, mapped to where it lands."""
        cfg = self.cfg
        # HF's module order (a trainer's named_parameters order): see ModelRunner's flat layout.
        out = {"model.embed_tokens.weight": whole(self.model.embed_tokens.weight)}
        qkv = [("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)]
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}"
            attn = layer.self_attn
            out.update(split(f"{p}.self_attn", attn.qkv_proj.weight, qkv, "weight"))
            if cfg.qkv_bias:
                out.update(split(f"{p}.self_attn", attn.qkv_proj.bias, qkv, "bias"))
            out[f"{p}.self_attn.o_proj.weight"] = whole(attn.o_proj.weight)
            if cfg.qk_norm:
                out[f"{p}.self_attn.q_norm.weight"] = whole(attn.q_norm.weight)
                out[f"{p}.self_attn.k_norm.weight"] = whole(attn.k_norm.weight)
            out.update(layer.mlp.hf_weights(p))
            out[f"{p}.input_layernorm.weight"] = whole(layer.input_layernorm.weight)
            out[f"{p}.post_attention_layernorm.weight"] = whole(
                layer.post_attention_layernorm.weight)
        out["model.norm.weight"] = whole(self.model.norm.weight)
        out["lm_head.weight"] = whole(self.lm_head_weight)
        if self.draft is not None:  # optional in an update: without them the draft is stale
            out.update(self.draft.hf_weight_map())
        return out

    def required_weight_names(self) -> set[str]:
        """Names a full checkpoint must provide: no aliases (their storage has other names),
        and a tied lm_head may be omitted."""
        names = {n for n, slot in self.hf_weight_map().items()
                 if not slot.covers and not n.startswith("draft.")}
        if self.cfg.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names
