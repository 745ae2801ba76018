"""A prompt's images: what a request keeps of them from admission to finish.

`prompt_images` turns a row's image inputs into `PromptImages` beside the expanded prompt ids:
each image preprocessed (image_processing.py), its placeholder run made as long as its grid
says (one placeholder or the expanded run both give the same ids), the prompt's M-RoPE
positions, and the prompt's cache keys: its ids with every image token replaced by a negative
key taken from that image's content hash. The radix tree keys a prompt by those, so the same
text with another image never matches past the image and the same image does; a match is cut
back to an image's first token if it would end inside the image (`match_end`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hotswap.engine.config import ModelConfig
from hotswap.engine.layers.rotary import MRopePositions, mrope_positions
from hotswap.engine.models.qwen_vl import expand_image_tokens, image_starts
from hotswap.engine.multimodal.image_processing import (
    ImageProcessorConfig,
    ProcessedImage,
    process_images,
)


def image_key(image_hash: str) -> int:
    """The cache key every token of an image's run takes: negative (never a vocabulary id),
    60 bits of its content hash."""
    return -1 - int(image_hash[:15], 16)


@dataclass(frozen=True)
class PromptImage:
    image: ProcessedImage
    offset: int  # where its run starts in the expanded prompt
    tokens: int  # the run's length

    @property
    def end(self) -> int:
        return self.offset + self.tokens

    def meta(self) -> dict[str, Any]:
        """What an output says of it (meta_info["images"])."""
        return {"grid_thw": list(self.image.grid_thw), "hash": self.image.hash,
                "offset": self.offset, "tokens": self.tokens}


@dataclass(frozen=True)
class PromptImages:
    images: tuple[PromptImage, ...]
    positions: MRopePositions
    keys: tuple[int, ...]  # the prompt's cache keys (image tokens as image_key)

    @property
    def hashes(self) -> list[str]:
        return [p.image.hash for p in self.images]

    def match_end(self, n: int) -> int:
        """The longest prefix of at most n tokens that ends outside every image's run."""
        for p in self.images:
            if p.offset < n < p.end:
                return p.offset
        return n

    def overlaps(self, start: int, end: int) -> bool:
        """Whether tokens start..end-1 hold a token of some image."""
        return any(p.offset < end and start < p.end for p in self.images)

    def rope(self, start: int, end: int) -> torch.Tensor | int:
        """The M-RoPE positions of tokens start..end-1: an offset to add to the plain positions
        where the three streams are equal (text before the first image: 0; generated tokens:
        the decode offset), else [3, end - start]."""
        if end <= self.images[0].offset:
            return 0
        if start >= self.positions.prompt.shape[1]:
            return self.positions.delta
        return self.positions.span(start, end)


def prompt_images(ids: list[int], images: list[Any] | None, model: ModelConfig | None,
                  processor: ImageProcessorConfig | None, field: str = "input_ids"
                  ) -> tuple[list[int], PromptImages | None]:
    """The expanded prompt ids and their images, for prompt ids holding one placeholder run
    per image (`field` names where they came from). Raises ValueError naming the field: an
    image on a text-only model, an image that does not decode, placeholders that do not match
    the images."""
    images = list(images or [])
    if model is None or model.vision is None or processor is None:
        if images:
            name = "this model" if model is None else model.architecture
            raise ValueError(f"image_data: {name} is a text-only model; it takes no images")
        return ids, None
    processed = process_images(images, processor)
    merge = processor.merge_size
    grids = [p.grid_thw for p in processed]
    ids = expand_image_tokens(ids, grids, model.image_token_id, merge, field)
    if not processed:
        return ids, None
    starts = image_starts(ids, model.image_token_id)
    placed = tuple(PromptImage(p, s, p.num_tokens(merge)) for p, s in zip(processed, starts))
    keys = list(ids)
    for p in placed:
        keys[p.offset: p.end] = [image_key(p.image.hash)] * p.tokens
    return ids, PromptImages(placed, mrope_positions(ids, grids, model.image_token_id, merge),
                             tuple(keys))
