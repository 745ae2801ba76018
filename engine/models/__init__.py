"""Model registry: config.json `architectures` -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

from hotswap.engine.config import ModelConfig
from hotswap.engine.config.model import SCORING_ARCHITECTURES, VISION_ARCHITECTURES

_REGISTRY = {
    "LlamaForCausalLM": "hotswap.engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "hotswap.engine.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "hotswap.engine.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "hotswap.engine.models.moe:MoeForCausalLM",
    "MixtralForCausalLM": "hotswap.engine.models.moe:MoeForCausalLM",
    **{arch: "hotswap.engine.models.reward:LlamaForScoring" for arch in SCORING_ARCHITECTURES},
    **{arch: "hotswap.engine.models.qwen_vl:QwenVLForConditionalGeneration"
       for arch in VISION_ARCHITECTURES},
}


def build_model(cfg: ModelConfig, max_positions: int) -> nn.Module:
    if cfg.architecture not in _REGISTRY:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; "
                         f"supported: {', '.join(_REGISTRY)}")
    module, cls = _REGISTRY[cfg.architecture].split(":")
    return getattr(importlib.import_module(module), cls)(cfg, max_positions)
