"""Image inputs (engine/multimodal/image_processing.py): every encoding decodes to the same
image and hash, bad inputs are refused naming the field, and the preprocessing equals
transformers' Qwen2VLImageProcessorPil bit for bit."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import transformers
from PIL import Image

from hotswap.engine.multimodal.image_processing import (
    ImageProcessorConfig,
    image_hash,
    load_image,
    process_image,
    process_images,
)

# Qwen2.5-VL's processor (patch 14, CLIP mean/std, HF's default pixel bounds) and Qwen3-VL's
# (patch 16, mean/std 0.5) with small bounds, so that large images are downscaled.
PROCESSORS = [dict(),
              dict(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                   min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 40)]


def picture(mode: str, width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, (height, width, bands), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if bands == 1 else pixels, mode)


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def paletted_with_transparency() -> Image.Image:
    image = picture("L", 33, 47, seed=3).convert("P")
    image.info["transparency"] = 0
    return image


@pytest.mark.parametrize("kw", PROCESSORS, ids=["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("image", [
    picture("RGB", 100, 60), picture("RGBA", 57, 91), picture("L", 30, 33),
    picture("RGB", 5, 9), picture("RGB", 1500, 1100), picture("RGB", 28, 28),
    paletted_with_transparency(),
], ids=["rgb", "rgba", "gray", "tiny", "large", "exact", "paletted"])
def test_pixel_values_and_grid_equal_hf(kw, image):
    hf = transformers.Qwen2VLImageProcessorPil(**kw)
    ref = hf(images=[image], return_tensors="pt")
    ours = process_image(image, ImageProcessorConfig.from_dict(hf.to_dict()))
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert (ours.pixel_values == ref["pixel_values"]).all()


def test_several_images_concatenate_as_hf(tmp_path):
    hf = transformers.Qwen2VLImageProcessorPil(**PROCESSORS[1])
    hf.save_pretrained(tmp_path)  # preprocessor_config.json, as a model folder holds it
    images = [picture("RGB", 300, 200), picture("RGBA", 40, 40), picture("L", 64, 128)]
    ref = hf(images=images, return_tensors="pt")
    ours = process_images(images, ImageProcessorConfig.from_path(str(tmp_path)))
    assert [o.grid_thw for o in ours] == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    stacked = np.concatenate([o.pixel_values.numpy() for o in ours])
    assert (stacked == ref["pixel_values"].numpy()).all()
    assert [o.num_tokens(2) for o in ours] == (ref["image_grid_thw"].prod(-1) // 4).tolist()


def test_every_encoding_decodes_to_the_same_image_and_hash(tmp_path):
    image = picture("RGB", 40, 30)
    data = png(image)
    path = tmp_path / "image.png"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    forms = [image, data, bytearray(data), b64, f"data:image/png;base64,{b64}", str(path),
             f"file://{path}", path, {"bytes": data, "path": None}, {"path": str(path)}]
    hashes = {image_hash(load_image(form)) for form in forms}
    assert hashes == {image_hash(image)}
    jpeg = io.BytesIO()
    image.save(jpeg, format="JPEG")  # lossy: other pixels, another hash
    assert image_hash(load_image(jpeg.getvalue())) != image_hash(image)
    assert image_hash(picture("RGB", 40, 30, seed=1)) != image_hash(image)


@pytest.mark.parametrize("data, message", [
    (b"not an image", "not a decodable image"),
    (b"", "the image is empty"),
    ("%%% not base64 %%%", "neither a local file nor valid base64"),
    ("data:image/png,rawtext", "a data: URL must be base64"),
    ("https://example.com/cat.png", "image URLs are not fetched"),
    (12, "an image must be a PIL image, bytes"),
    ({"url": "x"}, "an image dict needs 'bytes' or 'path'"),
    (png(picture("RGB", 3, 700)), "aspect ratio 233 is over 200"),
    (png(picture("RGB", 100, 100)), r"100x100 = 10000 pixels, over the limit of 5000"),
])
def test_bad_images_are_refused_naming_the_field(data, message):
    cfg = ImageProcessorConfig(max_image_pixels=5000)
    good = picture("RGB", 20, 20)
    with pytest.raises(ValueError, match=rf"^image_data\[1\]: .*{message}"):
        process_images([good, data], cfg)
    assert process_images([good], cfg)[0].grid_thw == (1, 4, 4)  # nothing else lost
