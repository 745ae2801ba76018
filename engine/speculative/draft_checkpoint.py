"""The learned draft's checkpoint: its tensor names and shapes, and its folder.

DIR/model.safetensors holds the tensors of `draft_shapes` (HF-style names, the policy's dtype or
float32); DIR/config.json says {"format": "hotswap-draft", "format_version": 1, the sizes, the
policy's vocab_size, "token_map" (the draft's sorted vocabulary), "trained_tokens", "policy":
{"path", "weights_sha"}}. `load_draft_config` checks a folder before anything reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from torch import nn

from hotswap.engine.config.model import ModelConfig

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


def policy_weights_sha(policy: nn.Module) -> str:
    """A short hash of the policy's head and final norm: which policy a draft was trained on."""
    digest = hashlib.sha256()
    for t in (policy.get_output_embeddings().weight, policy.get_decoder().norm.weight):
        digest.update(t.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


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
            raise ValueError(f"draft checkpoint {directory!r}: missing file {p}")
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


