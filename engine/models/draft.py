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

Its checkpoint is a folder: DIR/model.safetensors holds the tensors of `draft_shapes` (HF-style
names, the policy's dtype or float32); DIR/config.json says {"format": "hotswap-draft",
"format_version": 1, the sizes, the policy's vocab_size, "token_map" (the draft's sorted
vocabulary), "trained_tokens", "policy": {"path", "weights_sha"}, and optionally
"proposal_scale": the draft samples its proposals at the request's temperature times this
(default 1.0; the warm start measures it)}. `load_draft_config` checks a folder before anything
reads it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

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


DRAFT_FORMAT = "hotswap-draft"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def as_model_config(policy_config: Any) -> ModelConfig:
    """A ModelConfig from a config.json dict, an HF PretrainedConfig or a ModelConfig."""
    if isinstance(policy_config, ModelConfig):
        return policy_config
    if hasattr(policy_config, "to_dict"):
        policy_config = policy_config.to_dict()
    return ModelConfig.from_dict(policy_config)


def draft_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor of the draft of a policy with config `cfg`, with its shape."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    attn, mlp = "draft.layer.self_attn.", "draft.layer.mlp."
    return {"draft.fc.weight": (h, 2 * h),
            attn + "q_proj.weight": (q, h), attn + "k_proj.weight": (kv, h),
            attn + "v_proj.weight": (kv, h), attn + "o_proj.weight": (h, q),
            mlp + "gate_proj.weight": (i, h), mlp + "up_proj.weight": (i, h),
            mlp + "down_proj.weight": (h, i),
            "draft.layer.input_layernorm.weight": (h,),
            "draft.layer.post_attention_layernorm.weight": (h,),
            "draft.norm.weight": (h,)}


def save_draft(directory: str, named_tensors: list[tuple[str, torch.Tensor]] | dict,
               token_map: list[int] | torch.Tensor, policy_config: Any, **meta: Any) -> str:
    """Write DIR/model.safetensors and DIR/config.json; checks names and shapes first."""
    from safetensors.torch import save_file

    cfg = as_model_config(policy_config)
    tensors = dict(named_tensors)
    check_tensor_shapes({n: tuple(t.shape) for n, t in tensors.items()}, cfg, directory)
    token_map = [int(t) for t in torch.as_tensor(token_map).tolist()]
    policy = {"path": meta.pop("policy_path", None), "weights_sha": meta.pop("weights_sha", None)}
    config = {"format": DRAFT_FORMAT, "format_version": FORMAT_VERSION,
              "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
              "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
              "token_map": token_map, "trained_tokens": int(meta.pop("trained_tokens", 0)),
              "policy": policy, **meta}
    os.makedirs(directory, exist_ok=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()},
              os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=1)
    return directory


def check_tensor_shapes(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, where: str) -> None:
    want = draft_shapes(cfg)
    missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
    if missing or extra:
        raise ValueError(f"{where}: draft tensors do not match: missing {missing}, "
                         f"unexpected {extra}")
    wrong = [f"{n} {shapes[n]} (the policy needs {want[n]})" for n in want
             if tuple(shapes[n]) != want[n]]
    if wrong:
        raise ValueError(f"{where}: draft tensor shapes do not fit the policy: {', '.join(wrong)}")


def load_draft_config(directory: str, policy_config: Any = None) -> dict[str, Any]:
    """Read and check DIR/config.json; with `policy_config`, also check that the draft's sizes
    and DIR/model.safetensors' shapes fit that policy. Raises ValueError naming what is wrong."""
    path = os.path.join(directory, CONFIG_FILE)
    weights = os.path.join(directory, WEIGHTS_FILE)
    for p in (path, weights):
        if not os.path.isfile(p):
            raise ValueError(f"draft checkpoint {directory!r}: missing file {p}; make one with: "
                             "python -m hotswap.engine.speculative.train_draft MODEL_PATH")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict) or config.get("format") != DRAFT_FORMAT:
        raise ValueError(f"{path}: 'format' must be {DRAFT_FORMAT!r}, got "
                         f"{config.get('format') if isinstance(config, dict) else config!r}")
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {config.get('format_version')!r} is not "
                         f"supported (expected {FORMAT_VERSION})")
    token_map = config.get("token_map")
    if not isinstance(token_map, list) or not token_map or token_map != sorted(set(token_map)):
        raise ValueError(f"{path}: 'token_map' must be a non-empty sorted list of distinct ids")
    scale = config.get("proposal_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 4:
        raise ValueError(f"{path}: 'proposal_scale' must be a number in (0, 4], got {scale!r}")
    if policy_config is not None:
        check_fits_policy(config, as_model_config(policy_config), path, weights)
    return config


def check_fits_policy(config: dict[str, Any], cfg: ModelConfig, path: str, weights: str) -> None:
    sizes = {"hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
             "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
             "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    wrong = [f"{k} {config.get(k)!r} (policy: {v})" for k, v in sizes.items()
             if config.get(k) != v]
    if wrong:
        raise ValueError(f"{path}: the draft does not fit the policy: {', '.join(wrong)}")
    if max(config["token_map"]) >= cfg.vocab_size or min(config["token_map"]) < 0:
        raise ValueError(f"{path}: token_map holds ids outside [0, {cfg.vocab_size})")
    from safetensors import safe_open

    with safe_open(weights, framework="pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    check_tensor_shapes(shapes, cfg, weights)


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
        self.proposal_scale = 1.0  # sampled proposals at the request's temperature times this

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


def load_draft(draft: DraftModel, path: str) -> None:
    """Read a draft made for this policy (config.json's token map, model.safetensors' tensors:
    every one of them) into `draft`."""
    meta = load_draft_config(path, draft.cfg)
    draft.token_map = torch.tensor(meta["token_map"], dtype=torch.int64,
                                   device=draft.fc.weight.device)
    draft.proposal_scale = float(meta.get("proposal_scale", 1.0))
    weight_map = draft.hf_weight_map()
    try:
        check_weights(weight_map, read_checkpoint_meta(path), set(weight_map))
    except ValueError as exc:
        raise ValueError(f"the draft at {path!r}: {exc}") from exc
    write_weights(weight_map, iter_checkpoint(path))
