"""The trainer's forward for vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

The model is HF's own (AutoModelForImageTextToText) and each sample is scored by its own
forward: the engine's expanded ids (prompt + response but its last token), the pixel values of
the sample's images (recomputed from the images with the engine's preprocessing, equal to HF's
processor) and their grids; HF computes the M-RoPE positions itself. The engine never samples
the vision special tokens (their logits are masked), so neither does the trainer's distribution:
their logits are -inf before the log-softmax, or the trainer's logprobs would sit above the
engine's by the mass those tokens hold.

One sequence per forward, no packing: a packed group would need M-RoPE positions and a block
mask that HF's VL models do not take together, and the vision tower would still run once per
sample; at the sizes a GRPO step feeds a VL model the forward is dominated by the decoder.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from hotswap.engine.config import ModelConfig
from hotswap.engine.multimodal.image_processing import (
    ImageProcessorConfig,
    ProcessedImage,
    process_images,
)
from hotswap.rollout.trajectory import RolloutBatch


def is_vision_language(path: str) -> bool:
    """Whether the checkpoint at `path` is a vision-language model (config.json has a
    vision_config)."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return isinstance(json.load(f).get("vision_config"), dict)


class VisionScorer:
    """Logprobs of a batch's trainable tokens under an HF vision-language model."""

    def __init__(self, model: torch.nn.Module, path: str):
        self.model = model
        self.processor = ImageProcessorConfig.from_path(path)
        config = ModelConfig.from_path(path)
        self.image_token_id = config.image_token_id
        self.masked = torch.tensor(config.vision_token_ids, dtype=torch.long)

    def images(self, batch: RolloutBatch, row: int) -> list[ProcessedImage]:
        """A row's images, preprocessed; checked against what the engine reported of them
        (grid and content hash), so a trainer never scores other pixels than the engine saw."""
        processed = process_images(batch.images[row], self.processor)
        meta = batch.image_meta[row] if row < len(batch.image_meta) else []
        if meta and len(meta) != len(processed):
            raise ValueError(f"row {row}: {len(processed)} images, the engine saw {len(meta)}")
        for image, seen in zip(processed, meta):
            if list(image.grid_thw) != list(seen["grid_thw"]) or image.hash != seen["hash"]:
                raise ValueError(f"row {row}: image {seen['offset']}: the trainer's "
                                 f"preprocessing differs from the engine's ({image.grid_thw} "
                                 f"{image.hash[:12]} against {seen['grid_thw']} "
                                 f"{seen['hash'][:12]})")
        return processed

    def row_logprobs(self, batch: RolloutBatch, row: int, temperature: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(columns, log p) of one row's trainable response tokens: one forward over the
        prompt and the response but its last token, with the row's images."""
        prompt, resp = batch.prompt_ids[row], batch.response_ids[row]
        cols = torch.tensor([t for t, m in enumerate(batch.loss_mask[row]) if m],
                            dtype=torch.long)
        if not len(cols):
            return cols, torch.zeros(0)
        ids = torch.tensor([prompt + resp[:-1]], dtype=torch.long)
        inputs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
        images = self.images(batch, row)
        if images:
            weight = next(self.model.parameters())
            inputs["pixel_values"] = torch.cat([im.pixel_values for im in images]).to(
                weight.device, weight.dtype)
            inputs["image_grid_thw"] = torch.tensor([im.grid_thw for im in images])
            inputs["mm_token_type_ids"] = (ids == self.image_token_id).int()
        hidden = self.model.model(**inputs).last_hidden_state[0]
        logits = self.model.get_output_embeddings()(hidden[len(prompt) - 1 + cols]).float()
        if temperature > 0:
            logits = logits / temperature
        logits[:, self.masked] = float("-inf")
        targets = torch.tensor([resp[t] for t in cols.tolist()], dtype=torch.long)
        return cols, torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]

    def response_logprobs(self, batch: RolloutBatch, rows: list[int], r_len: int,
                          temperature: float) -> torch.Tensor:
        """[len(rows), r_len] log p of the rows' trainable tokens, 0 elsewhere."""
        out = torch.zeros((len(rows), r_len))
        for k, i in enumerate(rows):
            cols, logp = self.row_logprobs(batch, i, temperature)
            out = out.index_put((torch.full_like(cols, k), cols), logp)
        return out
