"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral (docs/moe.md).

They are the Llama-family decoder (llama.py: attention with Qwen3's q/k norms or without, the
norms, the head) with a sparse MoE block (layers/moe.py) as the MLP of every sparse layer; a
Qwen3-MoE config may keep dense MLPs in some layers (`mlp_only_layers`, `decoder_sparse_step`).

Checkpoints come in two namings, and `hf_weight_map` takes both at load and in every update:
per-expert tensors as on the hub (`mlp.experts.{e}.gate_proj.weight`, ...; Mixtral's
`block_sparse_moe.experts.{e}.w1.weight` with w1 = gate, w3 = up, w2 = down) and transformers
5's stacked ones (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]; Mixtral
then names its router `mlp.gate`). The per-expert names are the required ones; the stacked
names are aliases of the same storage (WeightSlot.covers), so an update may send either, or
some experts only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hotswap.engine.config import ModelConfig
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.layers.moe import FusedMoE
from hotswap.engine.models.llama import (
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    WeightSlot,
    whole,
)

MIXTRAL = "MixtralForCausalLM"


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as experts; under tensor parallelism each rank holds its slice of
    every expert's intermediate dimension and `all_reduce` sums the ranks' partial outputs."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.moe_index = sum(cfg.is_moe_layer(i) for i in range(layer_id))  # in routes' layout
        self.mixtral = cfg.architecture == MIXTRAL
        self.experts = FusedMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
                                fp32_weights=self.mixtral)
        self.all_reduce: Callable[[torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor, fb: ForwardBatch | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """(residual +) moe(x); each token's experts go to fb.routes when it is set."""
        moe = self.experts(x)
        if fb is not None and fb.routes is not None:
            fb.routes[:, self.moe_index] = moe.topk_ids
        out = moe.hidden
        if self.all_reduce is not None:
            out = out.contiguous()
            self.all_reduce(out)
        return out if residual is None else out + residual

    def hf_weights(self, layer_prefix: str) -> dict[str, WeightSlot]:
        """Per-expert names (required) and the stacked aliases, the parameters first named in
        the order of transformers 5's named_parameters (the flat layout's order)."""
        moe = self.experts
        w13, w2 = moe.w13, moe.w2
        inter, hidden = moe.intermediate_size, moe.hidden_size
        if self.mixtral:
            per_expert, (gate, up, down) = f"{layer_prefix}.block_sparse_moe", ("w1", "w3", "w2")
        else:
            per_expert, (gate, up, down) = f"{layer_prefix}.mlp", ("gate_proj", "up_proj",
                                                                   "down_proj")
        router_name = f"{per_expert}.gate.weight"
        out = {router_name: whole(moe.gate.weight)}
        gate_up_names, down_names = [], []
        for e in range(moe.num_experts):
            p = f"{per_expert}.experts.{e}"
            out[f"{p}.{gate}.weight"] = WeightSlot(w13, 0, inter, expert=e)
            out[f"{p}.{up}.weight"] = WeightSlot(w13, inter, 2 * inter, expert=e)
            out[f"{p}.{down}.weight"] = WeightSlot(w2, 0, hidden, expert=e)
            gate_up_names += [f"{p}.{gate}.weight", f"{p}.{up}.weight"]
            down_names.append(f"{p}.{down}.weight")
        stacked = f"{layer_prefix}.mlp"
        aliases = {f"{stacked}.experts.gate_up_proj": WeightSlot(
                       w13, 0, moe.num_experts, covers=tuple(gate_up_names)),
                   f"{stacked}.experts.down_proj": WeightSlot(
                       w2, 0, moe.num_experts, covers=tuple(down_names))}
        if self.mixtral:  # transformers 5 renames block_sparse_moe to mlp
            aliases[f"{stacked}.gate.weight"] = whole(moe.gate.weight)._replace(
                covers=(router_name,))
            return {**out, **aliases}  # Mixtral: router, then experts
        return {**aliases, **out}  # Qwen3-MoE: experts, then router


class MoeModel(LlamaModel):
    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return SparseMoeBlock(cfg, layer_id) if cfg.is_moe_layer(layer_id) else LlamaMLP(
            cfg, layer_id)

    def _fused_decode_inputs(self, fb: ForwardBatch) -> None:
        return None  # the fused CPU decode kernel knows dense MLPs only


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM and MixtralForCausalLM."""

    model_class = MoeModel

    def quantize_weights(self, enable: bool, head: bool = False) -> int:
        """The linear layers' int8 copies and every MoE layer's experts' (routers stay float)."""
        total = super().quantize_weights(enable, head)
        for module in self.modules():
            if isinstance(module, FusedMoE):
                total += module.quantize(enable)
        return total

    def pack_weights(self, enable: bool = True, invariant: bool = False) -> None:
        super().pack_weights(enable, invariant)
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.pack_weights(enable, invariant)
