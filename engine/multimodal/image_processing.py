"""Images in prompts: decoding, a content hash, and the Qwen2-VL family's preprocessing.

`load_image` takes what a request may carry (a PIL image, raw bytes, base64, a `data:` URL, a
local path, a datasets-style {"bytes"| "path"} dict) and refuses what it cannot decode with a
ValueError naming the field. `image_hash` names an image by its decoded pixels, so the same
picture sent as PNG bytes, base64 or a data URL hashes the same. `process_image` equals
transformers' Qwen2VLImageProcessorPil (Qwen2-VL, Qwen2.5-VL and Qwen3-VL use it), Pillow and
numpy only: RGB (transparency composited on white), smart_resize to multiples of patch *
merge within min/max pixels (bicubic), rescale, normalize, then one row per patch of C * T * P
* P values (the frame repeated temporal_patch_size times) in spatial-merge-block order.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from PIL import Image

from hotswap.engine.client.request import image_bytes

# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, the processor's defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Decoded images above this many pixels are refused before their pixels are read (Pillow's
# own decompression-bomb error starts at twice its MAX_IMAGE_PIXELS, about 179M).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
MAX_ASPECT_RATIO = 200  # smart_resize's limit


@dataclass(frozen=True)
class ImageProcessorConfig:
    """preprocessor_config.json's fields that the Qwen2-VL processor reads, HF's defaults."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    max_image_pixels: int = MAX_IMAGE_PIXELS  # the decoded input's limit

    @classmethod
    def from_dict(cls, d: dict[str, Any], **overrides: Any) -> ImageProcessorConfig:
        """From preprocessor_config.json: `size` {shortest_edge, longest_edge} (transformers 5)
        or min_pixels / max_pixels (older files) give the pixel bounds."""
        known = {f.name for f in fields(cls)}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known}
        size = d.get("size") or {}
        if "shortest_edge" in size:
            kw.setdefault("min_pixels", size["shortest_edge"])
        if "longest_edge" in size:
            kw.setdefault("max_pixels", size["longest_edge"])
        return cls(**{**kw, **overrides})

    @classmethod
    def from_path(cls, model_path: str, **overrides: Any) -> ImageProcessorConfig:
        """The model folder's preprocessor_config.json, or the defaults without one."""
        path = os.path.join(model_path, "preprocessor_config.json")
        if not os.path.isfile(path):
            return cls(**overrides)
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f), **overrides)

    @classmethod
    def for_engine(cls, model_path: str, merge_size: int, min_pixels: int | None,
                   max_pixels: int | None) -> ImageProcessorConfig:
        """An engine's preprocessing: the model's preprocessor_config.json, with the engine's
        image_min_pixels / image_max_pixels (when set) in place of its bounds; checked against
        the vision tower's spatial merge size."""
        bounds = {name: value for name, value in (("min_pixels", min_pixels),
                                                  ("max_pixels", max_pixels))
                  if value is not None}
        processor = cls.from_path(model_path, **bounds)
        if processor.merge_size != merge_size:
            raise ValueError(f"preprocessor_config.json merge_size {processor.merge_size} "
                             f"differs from config.json's spatial_merge_size {merge_size}")
        if processor.min_pixels > processor.max_pixels:
            raise ValueError(f"image pixels: min {processor.min_pixels} over max "
                             f"{processor.max_pixels}")
        return processor

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision tower takes it."""

    pixel_values: torch.Tensor  # [t * h * w, C * T * P * P] float32: one row per patch
    grid_thw: tuple[int, int, int]  # in patches
    hash: str  # image_hash of the decoded input

    def num_tokens(self, merge_size: int) -> int:
        """The language-model tokens it becomes (its placeholder's expanded length)."""
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """(height, width) rounded to multiples of factor, the aspect kept as near as may be, the
    area within [min_pixels, max_pixels] (HF's smart_resize)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is over "
                         f"{MAX_ASPECT_RATIO}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image(data: Any, field: str = "image_data",
               max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """A decoded PIL image from what a request carries; ValueError naming `field` otherwise."""
    if isinstance(data, Image.Image):
        image = data
    else:
        raw = image_bytes(data, field)
        if not raw:
            raise ValueError(f"{field}: the image is empty (no bytes)")
        try:
            image = Image.open(io.BytesIO(raw))
        except (OSError, Image.DecompressionBombError) as exc:
            raise ValueError(f"{field}: not a decodable image ({exc})") from exc
    width, height = image.size
    if width * height == 0:
        raise ValueError(f"{field}: the image is empty ({width}x{height} pixels)")
    if width * height > max_pixels:
        raise ValueError(f"{field}: the image has {width}x{height} = {width * height} pixels, "
                         f"over the limit of {max_pixels}")
    try:
        image.load()
    except (OSError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ValueError(f"{field}: not a decodable image ({exc})") from exc
    return image


def image_hash(image: Image.Image) -> str:
    """sha256 of the decoded image (mode, size, pixels): the same picture in any encoding
    hashes the same; another picture (or the same one resized) does not."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (as transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def process_image(data: Any, cfg: ImageProcessorConfig, field: str = "image_data"
                  ) -> ProcessedImage:
    """Decode, hash and preprocess one image (see the module's docstring)."""
    image = load_image(data, field, cfg.max_image_pixels)
    digest = image_hash(image)
    if cfg.do_convert_rgb:
        image = to_rgb(image)
    if cfg.do_resize:
        try:
            height, width = smart_resize(image.height, image.width, cfg.factor,
                                         cfg.min_pixels, cfg.max_pixels)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from exc
        image = image.resize((width, height), Image.Resampling(cfg.resample))
    pixels = np.asarray(image)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if cfg.do_rescale:  # in float64, then float32, as transformers' rescale
        pixels = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        pixels = pixels.astype(np.float32)
        pixels = (pixels - np.array(cfg.image_mean, np.float32)) / np.array(cfg.image_std,
                                                                            np.float32)
    patches, grid = patchify(pixels.astype(np.float32), cfg)
    return ProcessedImage(torch.from_numpy(patches), grid, digest)


def patchify(pixels: np.ndarray, cfg: ImageProcessorConfig
             ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[H, W, C] -> [h * w, C * T * P * P] patches in spatial-merge-block order, and (1, h, w)."""
    height, width, channels = pixels.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if height % (p * m) or width % (p * m):
        raise ValueError(f"image of {height}x{width} pixels is not a multiple of patch_size * "
                         f"merge_size = {p * m} (resize it, or keep do_resize on)")
    h, w = height // p, width // p
    blocks = pixels.reshape(h // m, m, p, w // m, m, p, channels)
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)  # (h/m, w/m, m, m, C, P, P)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return np.ascontiguousarray(frames.reshape(h * w, channels * t * p * p)), (1, h, w)


def process_images(images: list[Any], cfg: ImageProcessorConfig, field: str = "image_data"
                   ) -> list[ProcessedImage]:
    """process_image of each, field names indexed (`image_data[1]`)."""
    return [process_image(image, cfg, f"{field}[{i}]") for i, image in enumerate(images)]
