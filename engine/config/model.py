"""ModelConfig: what the engine reads of a checkpoint's config.json (HF names and defaults), for
causal LMs, reward models (a score head), mixture-of-experts and vision-language models."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

CAUSAL_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                        "Qwen3MoeForCausalLM", "MixtralForCausalLM")
# Reward models: the decoder of the same family with a `score` head (docs/api.md#scoring).
SCORING_HEADS = ("ForSequenceClassification", "ForTokenClassification")
SCORING_ARCHITECTURES = tuple(f"{family}{head}" for family in ("Llama", "Qwen2", "Qwen3")
                              for head in SCORING_HEADS)
# Vision-language models -> the text family of their language model (engine/models/qwen_vl.py).
VISION_ARCHITECTURES = {"Qwen2VLForConditionalGeneration": "Qwen2",
                        "Qwen2_5_VLForConditionalGeneration": "Qwen2",
                        "Qwen3VLForConditionalGeneration": "Qwen3"}
SUPPORTED_ARCHITECTURES = CAUSAL_ARCHITECTURES + SCORING_ARCHITECTURES + tuple(
    VISION_ARCHITECTURES)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # Mixture of experts (docs/moe.md); num_experts 0 is a dense model. A layer is sparse unless
    # listed in mlp_only_layers or off the decoder_sparse_step grid, as in HF's Qwen3-MoE.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # The attention window the checkpoint's attention uses (Mistral-style sliding window), or
    # None for full attention. Not implemented: the engine's context stops at it instead.
    sliding_window: int | None = None
    # A reward model's score head (hidden -> num_labels); 0 for a model that generates.
    num_labels: int = 0
    score_bias: bool = False  # *ForTokenClassification's head has a bias unless told otherwise
    # A vision-language model: config.json's vision_config (engine/models/vision.py reads it),
    # its special tokens, and the M-RoPE split of the rotary frequencies over (t, h, w).
    vision: dict[str, Any] | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"config.json field 'architectures' = {archs!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        vision = _vision_fields(arch, cfg)
        if vision:  # the language model's fields sit in text_config (transformers >= 5)
            cfg = {**cfg, **(cfg.get("text_config") or {}),
                   "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "vocab_size"):
            if key not in cfg:
                raise ValueError(f"config.json is missing required field '{key}'")
        num_heads = cfg["num_attention_heads"]
        # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_scaling`.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        kind = rope.get("rope_type", rope.get("type", "default"))
        scaling = rope if kind not in ("default", "mrope") else None  # mrope: HF's older name
        family = VISION_ARCHITECTURES.get(arch) or arch.split("For")[0]  # Llama, Qwen2, ...
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=family == "Qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family in ("Qwen3", "Qwen3Moe"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            sliding_window=_sliding_window(cfg),
            **_moe_fields(arch, cfg),
            **_score_fields(arch, cfg),
            **vision,
        )

    @classmethod
    def from_path(cls, model_path: str) -> ModelConfig:
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"no config.json in model_path {model_path!r}")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @property
    def task(self) -> str:
        """"generate", "classify" (*ForSequenceClassification) or "token_classify"."""
        if not self.num_labels:
            return "generate"
        return "token_classify" if self.architecture.endswith("ForTokenClassification") else (
            "classify")

    @property
    def vision_token_ids(self) -> tuple[int, ...]:
        """A vision-language model's special tokens (placeholders, image bounds): never sampled."""
        ids = (self.image_token_id, self.video_token_id, self.vision_start_token_id,
               self.vision_end_token_id)
        return tuple(i for i in ids if i is not None)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.is_moe_layer(i) for i in range(self.num_layers))


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window of a config whose attention slides (HF: Mixtral/Mistral whenever
    `sliding_window` is set; Qwen2/Qwen3 only with `use_sliding_window`), else None."""
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", True):
        return None
    return int(window)


def _vision_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config.json's vision fields (HF's names and defaults)."""
    if arch not in VISION_ARCHITECTURES:
        return {}
    if not isinstance(cfg.get("vision_config"), dict):
        raise ValueError(f"config.json of {arch} has no 'vision_config' object")
    text = cfg.get("text_config") or cfg
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    qwen3 = arch.startswith("Qwen3")
    section = rope.get("mrope_section") or ([24, 20, 20] if qwen3 else [16, 24, 24])
    return dict(vision=cfg["vision_config"], image_token_id=cfg.get("image_token_id", 151655),
                video_token_id=cfg.get("video_token_id", 151656),
                vision_start_token_id=cfg.get("vision_start_token_id", 151652),
                vision_end_token_id=cfg.get("vision_end_token_id", 151653),
                mrope_section=tuple(section), mrope_interleaved=qwen3)


def _score_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A reward model's head from an HF config.json: num_labels (HF writes id2label; its default
    is 2) and whether the head has a bias (HF's token_classification_bias, default True)."""
    if arch not in SCORING_ARCHITECTURES:
        return {}
    labels = cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2
    if not isinstance(labels, int) or labels < 1:
        raise ValueError(f"config.json: num_labels must be a positive integer, got {labels!r}")
    bias = arch.endswith("ForTokenClassification") and cfg.get(
        "token_classification_bias") is not False
    return dict(num_labels=labels, score_bias=bias)


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's MoE fields from an HF config.json (HF's names and defaults)."""
    if arch == "MixtralForCausalLM":  # every layer sparse, experts of intermediate_size
        return dict(num_experts=cfg.get("num_local_experts", 8),
                    num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    if arch != "Qwen3MoeForCausalLM":
        return {}
    # transformers 5 writes num_experts as num_local_experts (Qwen3MoeConfig.attribute_map).
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    for key, value in (("num_experts", experts),
                       ("moe_intermediate_size", cfg.get("moe_intermediate_size")),
                       ("num_experts_per_tok", cfg.get("num_experts_per_tok"))):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.json field '{key}' must be a positive integer for "
                             f"{arch}, got {value!r}")
    return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
                mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))
