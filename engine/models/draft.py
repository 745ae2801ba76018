"""The learned draft (speculative="draft"): an EAGLE-style head on the policy, run by
engine/speculative/draft.py and trained by engine/speculative/train_draft.py.

For tokens x_0..x_s with the policy's normed last hidden states F (what its head multiplies;
F_{-1} = 0), the draft at position s computes

    z_s = fc([E[x_s], F_{s-1}])       E: the policy's embedding; fc: 2H -> H, no bias
    g_s = one Llama decoder layer(z_s) its own K/V, RoPE at position s, causal over 0..s
    G_s = rmsnorm(g_s) * w_norm       the draft's guess of F_s
    logits_s = G_s @ W[token_map].T   W: the policy's head, restricted to the draft's vocabulary

so it predicts x_{s+1}; chained, position s+1 consumes (G_s, its own guess of x_{s+1}). It
shares the policy's embedding, rotary table and head: a policy update moves them with it, and
only fc, the layer and the norm (the `draft.*` tensors) are its own. The token map (the few
thousand ids the policy emits most) is fixed when the draft is made.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from torch import nn

from hotswap.engine.config import ModelConfig
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.layers import cpu_kernels
from hotswap.engine.layers.linear import Linear
from hotswap.engine.layers.norm import RMSNorm
from hotswap.engine.models.llama import (
    SMALL_HEAD_ROWS,
    LlamaDecoderLayer,
    LlamaMLP,
    WeightSlot,
    split,
    whole,
)
from hotswap.engine.models.loader import (
    check_weights,
    iter_checkpoint,
    read_checkpoint_meta,
    write_weights,
)

PREFIX = "draft."
CONFIG_FORMAT = "hotswap-draft"


class DraftModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # the layer's own shape is the policy's, without q/k/v bias or q/k norms
        self.cfg = dataclasses.replace(cfg, qkv_bias=False, qk_norm=False)
        hidden = cfg.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(self.cfg, 0, LlamaMLP(self.cfg))
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.register_buffer("token_map", torch.zeros(0, dtype=torch.int64), persistent=False)
        self.head: torch.Tensor | None = None  # float32 W[token_map], rebuilt with the weights

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, fb: ForwardBatch
                ) -> torch.Tensor:
        """G [T, H] of the positions in `fb`, whose attention backend holds the draft's KV."""
        x = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
        return self.norm(self.layer(x, fb))

    def logits(self, guess: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the token map [rows, Vd]: a bf16 head's rows as they lie for a
        few rows (half the bytes of float32, float32 sums), else in float32."""
        x = guess.float()
        head = self.head
        if (head.dtype == torch.bfloat16 and len(x) <= SMALL_HEAD_ROWS
                and cpu_kernels.applies(head)):
            return cpu_kernels.small_linear(x, head)
        return x @ head.float().T

    def derive(self, head_weight: torch.Tensor) -> None:
        """The policy head's rows of the token map (after every weight change)."""
        self.head = head_weight.detach().index_select(0, self.token_map)

    def hf_weight_map(self) -> dict[str, WeightSlot]:
        cfg, attn, mlp = self.cfg, self.layer.self_attn, self.layer.mlp
        p = f"{PREFIX}layer"
        qkv = [("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)]
        return {f"{PREFIX}fc.weight": whole(self.fc.weight),
                **split(f"{p}.self_attn", attn.qkv_proj.weight, qkv, "weight"),
                f"{p}.self_attn.o_proj.weight": whole(attn.o_proj.weight),
                **mlp.hf_weights(p),
                f"{p}.input_layernorm.weight": whole(self.layer.input_layernorm.weight),
                f"{p}.post_attention_layernorm.weight":
                    whole(self.layer.post_attention_layernorm.weight),
                f"{PREFIX}norm.weight": whole(self.norm.weight)}


def read_draft_config(path: str, cfg: ModelConfig) -> dict:
    """The draft's config.json, checked against the policy: ValueError naming what is wrong."""
    file = os.path.join(path, "config.json")
    hint = "make one with: python -m hotswap.engine.speculative.train_draft MODEL_PATH"
    if not os.path.isfile(file) or not os.path.isfile(os.path.join(path, "model.safetensors")):
        raise ValueError(f"speculative='draft': no draft at {path!r} (config.json and "
                         f"model.safetensors); {hint}")
    with open(file) as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}: not JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != CONFIG_FORMAT:
        raise ValueError(f"{file}: not a hotswap draft (format {CONFIG_FORMAT!r})")
    wanted = {"hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
              "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    wrong = [f"{k}={meta.get(k)!r} (the policy's: {v})" for k, v in wanted.items()
             if meta.get(k) != v]
    if wrong:
        raise ValueError(f"{file}: made for another policy: {', '.join(wrong)}")
    token_map = meta.get("token_map")
    if (not isinstance(token_map, list) or not token_map
            or not all(isinstance(t, int) and 0 <= t < cfg.vocab_size for t in token_map)):
        raise ValueError(f"{file}: token_map must be a non-empty list of token ids below "
                         f"{cfg.vocab_size}")
    return meta


def load_draft(draft: DraftModel, path: str) -> None:
    """Read a draft made for this policy (config.json's token map, model.safetensors' tensors:
    every one of them) into `draft`."""
    meta = read_draft_config(path, draft.cfg)
    draft.token_map = torch.tensor(meta["token_map"], dtype=torch.int64,
                                   device=draft.fc.weight.device)
    weight_map = draft.hf_weight_map()
    try:
        check_weights(weight_map, read_checkpoint_meta(path), set(weight_map))
    except ValueError as exc:
        raise ValueError(f"the draft at {path!r}: {exc}") from exc
    write_weights(weight_map, iter_checkpoint(path))
