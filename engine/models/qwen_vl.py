"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a vision tower (models/vision.py) beside the decoder.

The language model is models/llama.py's (Qwen2's q/k/v biases for Qwen2(.5)-VL, Qwen3's q/k
norms for Qwen3-VL) under HF's `model.language_model.*` names, with two changes: its rotary
embedding takes M-RoPE positions (layers/rotary.py), and a step's image tokens
(ForwardBatch.vision) get the vision features as input embeddings, plus Qwen3-VL's deepstack
features after its first layers. The tower runs apart from the decoder (`encode_images`): its
output per image is what an encoder cache keeps, and a prefill chunk takes the rows of it that
its tokens cover.
"""

from __future__ import annotations

import torch

from hotswap.engine.config import ModelConfig
from hotswap.engine.core.forward_batch import ForwardBatch, VisionInputs
from hotswap.engine.layers.rotary import MRotaryEmbedding
from hotswap.engine.models.llama import LlamaForCausalLM, LlamaModel, WeightSlot, whole
from hotswap.engine.models.vision import VisionConfig, VisionFeatures, VisionTower


def image_token_count(grid: tuple[int, int, int], merge: int) -> int:
    """Language-model tokens of an image of grid (t, h, w) patches."""
    t, h, w = grid
    return t * h * w // (merge * merge)


def expand_image_tokens(ids: list[int], grids: list[tuple[int, int, int]], image_token_id: int,
                        merge: int, field: str = "input_ids") -> list[int]:
    """ids with each image's placeholder run made as long as the image's token count: a run of
    one placeholder is expanded, a run already that long is kept (both give the same ids)."""
    out: list[int] = []
    runs = 0
    i = 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out.append(ids[i])
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == image_token_id:
            j += 1
        if runs < len(grids):
            want = image_token_count(grids[runs], merge)
            if j - i not in (1, want):
                raise ValueError(f"{field}: image {runs} has a run of {j - i} placeholder tokens; "
                                 f"expected 1 or its {want} tokens")
            out += [image_token_id] * want
        runs, i = runs + 1, j
    if runs != len(grids):
        raise ValueError(f"{field} holds {runs} image placeholder(s) for {len(grids)} image(s)")
    return out


def image_starts(ids: list[int], image_token_id: int) -> list[int]:
    """Where each image's placeholder run starts in expanded ids (one run per image)."""
    return [i for i, t in enumerate(ids)
            if t == image_token_id and (i == 0 or ids[i - 1] != image_token_id)]


def split_features(features: VisionFeatures, grids: list[tuple[int, int, int]], merge: int
                   ) -> list[VisionFeatures]:
    """encode_images' output of several images, one VisionFeatures per image."""
    sizes = [image_token_count(g, merge) for g in grids]
    embeds = features.embeds.split(sizes)
    if features.deepstack is None:
        return [VisionFeatures(e, None) for e in embeds]
    return [VisionFeatures(e, d) for e, d in zip(embeds, features.deepstack.split(sizes, dim=1))]


def chunk_vision_inputs(images: list[tuple[int, VisionFeatures]], start: int, end: int,
                        row: int = 0) -> VisionInputs | None:
    """The VisionInputs of a prompt's tokens start..end-1 laid out from flat row `row` of a
    step: `images` are (where the image's run starts in the prompt, its features). A chunk may
    begin or end inside an image; None when it holds no image token."""
    rows, embeds, deepstack = [], [], []
    for first, feats in images:
        lo, hi = max(start, first), min(end, first + len(feats.embeds))
        if lo >= hi:
            continue
        rows.append(torch.arange(lo, hi) - start + row)
        embeds.append(feats.embeds[lo - first: hi - first])
        if feats.deepstack is not None:
            deepstack.append(feats.deepstack[:, lo - first: hi - first])
    if not rows:
        return None
    device = embeds[0].device
    return VisionInputs(torch.cat(rows).to(device), torch.cat(embeds),
                        torch.cat(deepstack, dim=1) if deepstack else None)


def join_vision_inputs(parts: list[VisionInputs | None]) -> VisionInputs | None:
    """One step's VisionInputs from its rows' (each already at its flat rows)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    deepstack = [p.deepstack for p in parts if p.deepstack is not None]
    return VisionInputs(torch.cat([p.rows for p in parts]), torch.cat([p.embeds for p in parts]),
                        torch.cat(deepstack, dim=1) if deepstack else None)


def _older_name(name: str) -> str:
    """A `model.visual.*` / `model.language_model.*` name in the layout before transformers 5."""
    return name.removeprefix("model.") if name.startswith("model.visual.") else name.replace(
        "model.language_model.", "model.", 1)


class QwenVLTextModel(LlamaModel):
    """The decoder with M-RoPE and image features in place of placeholder embeddings."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__(cfg, max_positions)
        self.rotary = MRotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                       cfg.rope_scaling, cfg.mrope_section, cfg.mrope_interleaved)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        vision: VisionInputs | None = fb.vision
        if vision is None:  # text, decode: the plain path (fused decode included)
            return super().forward(fb)
        x = self.embed_tokens(fb.input_ids)
        x.index_copy_(0, vision.rows, vision.embeds.to(x.dtype))
        fb.rope = self.rotary.lookup(fb.positions, x.dtype)
        deepstack = () if vision.deepstack is None else vision.deepstack.to(x.dtype)
        count = len(self.layers) if fb.num_layers is None else fb.num_layers
        for i, layer in enumerate(self.layers[:count]):
            x = layer(x, fb)
            if i < len(deepstack):
                x.index_add_(0, vision.rows, deepstack[i])
        return x


class QwenVLForConditionalGeneration(LlamaForCausalLM):
    model_class = QwenVLTextModel

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__(cfg, max_positions)
        self.vision_config = VisionConfig.from_model(cfg)
        if self.vision_config.out_hidden_size != cfg.hidden_size:
            raise ValueError(f"config.json vision_config.out_hidden_size "
                             f"{self.vision_config.out_hidden_size} must equal the language "
                             f"model's hidden_size {cfg.hidden_size}")
        self.visual = VisionTower(self.vision_config)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> VisionFeatures:
        """The vision features of images, in order: image i's rows follow image i-1's, as many
        as image_token_count(grids[i])."""
        weight = self.visual.patch_embed.proj.weight
        return self.visual(pixels.to(weight.device, weight.dtype), grids)

    def hf_weight_map(self) -> dict[str, WeightSlot]:
        """The tower's names first (HF's module order), then the text model's under
        `model.language_model.`; the older checkpoint layout (`visual.*`, `model.layers.*`,
        which transformers still writes for Qwen2.5-VL) names the same storage as aliases."""
        out = {name: whole(p) for name, p in self.visual.hf_weights().items()}
        out.update((name.replace("model.", "model.language_model.", 1), slot)
                   for name, slot in super().hf_weight_map().items())
        out.update({_older_name(name): slot._replace(covers=(name,))
                    for name, slot in out.items() if name.startswith("model.")})
        return out

    def unblockable(self) -> list[str]:
        """The tower's matmuls are torch's (deterministic=True's kernels are the decoder's)."""
        return [n for n in super().unblockable() if not n.startswith("visual.")]
