"""Reward models: Llama, Qwen2 and Qwen3 `*ForSequenceClassification` / `*ForTokenClassification`.

The decoder of llama.py with HF's `score` head (hidden -> num_labels; a bias on a token
classifier) in place of the lm_head: the head is what the causal model's logits path multiplies
(the final norm, the float32 head of a bf16 model, packed copies), so the scores are that path's
float32 outputs over num_labels classes instead of the vocabulary. Which rows are scored (a
sequence's last token, or every token) is the scheduler's choice, through the batch's
logits_indices, as for sampled rows.
"""

from __future__ import annotations

import torch
from torch import nn

from hotswap.engine.config import ModelConfig
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.layers.linear import Linear
from hotswap.engine.models.llama import LlamaForCausalLM, WeightSlot, whole


class LlamaForScoring(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.model = self.model_class(cfg, max_positions)
        self.score = Linear(cfg.hidden_size, cfg.num_labels, bias=cfg.score_bias)
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_quant = None
        self.fp32_head = None
        self.blocked_head = None
        self.pack_regions = {}
        self.draft = None  # a scorer never drafts

    @property
    def lm_head(self) -> Linear:
        """The head the causal model's paths (packing, int8, the float32 copy) treat as such."""
        return self.score

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.score.weight

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 scores [len(fb.logits_indices), num_labels] of the rows asked for."""
        scores = self.logits(self.model(fb)[fb.logits_indices])
        bias = self.score.bias
        return scores if bias is None else scores + bias.float()

    def hf_weight_map(self) -> dict[str, WeightSlot]:
        out = super().hf_weight_map()
        del out["lm_head.weight"]
        out["score.weight"] = whole(self.score.weight)
        if self.score.bias is not None:
            out["score.bias"] = whole(self.score.bias)
        return out

    def required_weight_names(self) -> set[str]:
        return {n for n, slot in self.hf_weight_map().items() if not slot.covers}
