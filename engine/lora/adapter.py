"""A LoRA adapter read from PEFT's format and checked against the model before anything runs.

PEFT stores `lora_A` as [rank, in_features] and `lora_B` as [out_features, rank] under names like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (saved files) or
`...q_proj.lora_A.default.weight` (a live PeftModel's named_parameters). The delta a target adds
to its projection's output is `scaling * B @ A @ x`, with scaling = alpha / rank (alpha /
sqrt(rank) under rsLoRA); the scaling is folded into B here, once.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hotswap.engine.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = TARGETS[:4]
_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?"
                   r"\.weight$")
# Config keys that change what the adapter computes in ways this engine does not implement.
_REFUSED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out",
            "modules_to_save": "modules_to_save", "rank_pattern": "rank_pattern",
            "alpha_pattern": "alpha_pattern", "layer_replication": "layer_replication"}


def check_model_targets(config: LoRAConfig, model: ModelConfig) -> None:
    """A mixture-of-experts model takes adapters on its attention only: LoRA on the experts
    (and on its dense MLP layers, if any) is not implemented."""
    mlp = [t for t in config.targets if t not in ATTENTION_TARGETS]
    if model.num_experts and mlp:
        raise ValueError(f"adapter config 'target_modules' {list(config.targets)}: LoRA on the "
                         f"MLP/expert weights ({', '.join(mlp)}) of the mixture-of-experts "
                         f"model {model.architecture} is not supported; target the attention "
                         f"only ({', '.join(ATTENTION_TARGETS)})")


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every projection a LoRA may target."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, cfg.q_size), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size),
            "o_proj": (cfg.q_size, h), "gate_proj": (h, inter), "up_proj": (h, inter),
            "down_proj": (inter, h)}


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], max_rank: int) -> LoRAConfig:
        if not isinstance(cfg, Mapping):
            raise ValueError("config_dict must be the adapter_config.json dict")
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"adapter config peft_type {cfg.get('peft_type')!r}: only LORA")
        for key, what in _REFUSED.items():
            if cfg.get(key):
                raise ValueError(f"adapter config '{key}': {what} is not supported")
        if cfg.get("bias", "none") != "none":
            raise ValueError(f"adapter config 'bias' = {cfg.get('bias')!r}: only 'none'")
        rank = cfg.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"adapter config 'r' must be a positive integer, got {rank!r}")
        if rank > max_rank:
            raise ValueError(f"adapter config 'r' = {rank} exceeds max_lora_rank {max_rank}")
        alpha = cfg.get("lora_alpha", 8)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise ValueError(f"adapter config 'lora_alpha' must be a number, got {alpha!r}")
        return cls(rank, float(alpha), _targets(cfg.get("target_modules")),
                   bool(cfg.get("use_rslora", False)))


def _targets(value: Any) -> tuple[str, ...]:
    if value == "all-linear":
        return TARGETS
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple, set)) or not names:
        raise ValueError("adapter config 'target_modules' must be a non-empty list of names")
    for name in names:
        if name not in TARGETS:
            raise ValueError(f"adapter config 'target_modules': {name!r} is not supported "
                             f"(supported: {', '.join(TARGETS)})")
    return tuple(t for t in TARGETS if t in names)


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host: (layer, target) -> (A [r, in], scaling * B [out, r])."""

    name: str
    config: LoRAConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    version: int = 0

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def parse_name(name: str) -> tuple[int, str, str]:
    """(layer, target, "A" | "B") of a PEFT tensor name; ValueError for anything else."""
    m = _NAME.search(name)
    if m is None:
        raise ValueError(f"adapter tensor {name!r} is not a LoRA A/B weight of a decoder layer")
    layer, target, which = int(m.group(1)), m.group(2), m.group(3)
    if target not in TARGETS:
        raise ValueError(f"adapter tensor {name!r}: target {target!r} is not supported "
                         f"(supported: {', '.join(TARGETS)})")
    return layer, target, which


def check_tensor_meta(name: str, shape: tuple[int, ...], config: LoRAConfig,
                      model: ModelConfig) -> tuple[int, str, str]:
    """Validate one tensor's name and shape against the config and the model."""
    check_model_targets(config, model)
    layer, target, which = parse_name(name)
    if not 0 <= layer < model.num_layers:
        raise ValueError(f"adapter tensor {name!r}: layer {layer} is out of range "
                         f"(the model has {model.num_layers})")
    if target not in config.targets:
        raise ValueError(f"adapter tensor {name!r}: {target!r} is not in target_modules "
                         f"{list(config.targets)}")
    fan_in, fan_out = target_shapes(model)[target]
    want = (config.rank, fan_in) if which == "A" else (fan_out, config.rank)
    if tuple(shape) != want:
        raise ValueError(f"adapter tensor {name!r} has shape {list(shape)}, expected "
                         f"{list(want)} (rank {config.rank})")
    return layer, target, which


def build_adapter(name: str, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping,
                  config_dict: Mapping[str, Any], model: ModelConfig, max_rank: int,
                  dtype: torch.dtype) -> LoRAAdapter:
    """Validate everything, then convert: a bad adapter raises before anything is kept."""
    if not isinstance(name, str) or not name:
        raise ValueError("lora_name must be a non-empty string")
    config = LoRAConfig.from_dict(config_dict, max_rank)
    check_model_targets(config, model)
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tname, t in items:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"adapter tensor {tname!r} must be a floating-point torch.Tensor")
        layer, target, which = check_tensor_meta(tname, tuple(t.shape), config, model)
        part = halves.setdefault((layer, target), {})
        if which in part:
            raise ValueError(f"adapter tensor {tname!r} repeats lora_{which} of layer {layer} "
                             f"{target}")
        part[which] = t
    if not halves:
        raise ValueError("the adapter holds no LoRA tensors")
    weights = {}
    for (layer, target), part in sorted(halves.items()):
        if len(part) != 2:
            missing = "B" if "A" in part else "A"
            raise ValueError(f"adapter is missing lora_{missing} of layer {layer} {target}")
        a = part["A"].detach().to("cpu", torch.float32)
        b = part["B"].detach().to("cpu", torch.float32) * config.scaling
        weights[(layer, target)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return LoRAAdapter(name, config, weights)


def read_peft_folder(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json dict, tensors) of a PEFT adapter folder; a corrupt file is a
    ValueError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"lora_path {path!r} is not a directory")
    cfg_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    for p in (cfg_path, weights_path):
        if not os.path.isfile(p):
            raise ValueError(f"lora_path {path!r} has no {os.path.basename(p)}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{cfg_path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_path}: holds a {type(config).__name__}, not a JSON object")
    try:
        LoRAConfig.from_dict(config, max_rank=1 << 30)  # rank limits are the engine's check
    except ValueError as exc:
        raise ValueError(f"{cfg_path}: {exc}") from exc
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{weights_path}: not a valid safetensors file ({exc})") from exc
    return config, tensors
