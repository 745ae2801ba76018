"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (engine/models/qwen_vl.py, vision.py; M-RoPE in
layers/rotary.py): tiny random checkpoints written here, driven through the ModelRunner without
a scheduler, in float32 against Hugging Face transformers' own models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures import Seq, write_tiny_vl_model
from PIL import Image

from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.executor.model_runner import ModelRunner
from hotswap.engine.layers.rotary import MRopePositions, mrope_positions
from hotswap.engine.models.qwen_vl import (
    chunk_vision_inputs,
    expand_image_tokens,
    image_starts,
    join_vision_inputs,
    split_features,
)
from hotswap.engine.multimodal.image_processing import ImageProcessorConfig, process_images

TOL = 1e-4
IMAGE, START, END = 5, 3, 4  # the fixture tokenizer's <|image_pad|>, <|vision_start|>, _end|>
ARCHS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
# Image sizes whose grids differ: windows cut short at the right and bottom edges (Qwen2.5-VL),
# a position table resampled up and down (Qwen3-VL), the smallest image (one token).
SIZES = [(150, 90), (40, 70), (20, 20)]


@pytest.fixture(scope="module", params=ARCHS)
def vl(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = write_tiny_vl_model(path, request.param)
    mcfg = ModelConfig.from_path(path)
    cfg = EngineConfig(model_path=path, dtype="float32", max_total_tokens=4096,
                       max_running_requests=8, attention_backend="torch").resolve(mcfg)
    return path, hf, ModelRunner(cfg, mcfg)


def pictures(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def prompt(n_images: int) -> list[int]:
    """Text around n unexpanded image placeholders (vision_start, image_pad, vision_end)."""
    ids = [1, 40, 41]
    for i in range(n_images):
        ids += [START, IMAGE, END, 50 + i, 60 + i]
    return ids + [70, 71, 72]


def inputs(path: str, n_images: int, seed: int = 0):
    """(expanded ids, processed images) of a prompt with the first n of SIZES."""
    images = process_images(pictures(SIZES[:n_images], seed), ImageProcessorConfig.from_path(path))
    ids = expand_image_tokens(prompt(n_images), [im.grid_thw for im in images], IMAGE, 2)
    return ids, images


@torch.no_grad()
def hf_logits(hf, ids: list[int], images) -> torch.Tensor:
    kw = {}
    if images:
        kw = dict(pixel_values=torch.cat([im.pixel_values for im in images]),
                  image_grid_thw=torch.tensor([im.grid_thw for im in images]),
                  mm_token_type_ids=torch.tensor([[int(t == IMAGE) for t in ids]]))
    return hf(input_ids=torch.tensor([ids]), **kw).logits[0]


def features(runner: ModelRunner, images):
    """Each image's features and where its run starts (by image_starts of the ids)."""
    if not images:
        return []
    feats = runner.model.encode_images(torch.cat([im.pixel_values for im in images]),
                                       [im.grid_thw for im in images])
    return split_features(feats, [im.grid_thw for im in images], 2)


def step(runner: ModelRunner, rows: list[tuple[Seq, int, MRopePositions, list]]
         ) -> list[torch.Tensor]:
    """One forward over (seq, new tokens, its M-RoPE positions, its images as (run start,
    features)) rows: per-row logits of the new tokens, as the scheduler will assemble a step."""
    ids, slots, reqs, prefixes, exts, positions, vision = [], [], [], [], [], [], []
    for seq, n, mrope, images in rows:
        i, s, p, e = seq.plan(n)
        vision.append(chunk_vision_inputs(images, p, p + e, row=len(ids)))
        positions.append(mrope.span(p, p + e))
        ids += i
        slots.append(s)
        reqs.append(seq.row)
        prefixes.append(p)
        exts.append(e)
    fb = ForwardBatch.build(ids, torch.cat(slots), reqs, prefixes, exts, list(range(len(ids))))
    fb.positions = torch.cat(positions, dim=1)
    fb.vision = join_vision_inputs(vision)
    return list(runner.forward(fb).split(exts))


def request(runner: ModelRunner, path: str, n_images: int, extra: list[int] = (), seed: int = 0):
    ids, images = inputs(path, n_images, seed)
    ids = ids + list(extra)
    prompt_len = len(ids) - len(extra)
    mrope = mrope_positions(ids[:prompt_len], [im.grid_thw for im in images], IMAGE, 2)
    runs = list(zip(image_starts(ids, IMAGE), features(runner, images)))
    return ids, images, mrope, runs


def test_vision_tower_matches_hf(vl):
    _, hf, runner = vl
    pixels = torch.randn(8 * 10 + 4 * 4 + 2 * 2 + 2 * 6 * 4, runner.model.vision_config.patch_dim,
                         generator=torch.Generator().manual_seed(0))
    grids = [(1, 8, 10), (1, 4, 4), (1, 2, 2), (2, 6, 4)]  # the last with two frames
    ours = runner.model.encode_images(pixels, grids)
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=torch.tensor(grids))
    assert ours.embeds.shape == ref.pooler_output.shape
    assert (ours.embeds - ref.pooler_output).abs().max() < TOL
    if ours.deepstack is not None:
        assert len(ours.deepstack) == len(ref.deepstack_features) == 2
        for a, b in zip(ours.deepstack, ref.deepstack_features):
            assert (a - b).abs().max() < TOL


@pytest.mark.parametrize("n_images", [0, 1, 2, 3])
def test_prompt_logits_match_hf(vl, n_images):
    path, hf, runner = vl
    ids, images, mrope, runs = request(runner, path, n_images)
    (ours,) = step(runner, [(Seq(runner, ids), len(ids), mrope, runs)])
    ref = hf_logits(hf, ids, images)
    assert ref.abs().max() > 1  # logits with spread: the comparison means something
    assert (ours - ref).abs().max() < TOL


def test_chunked_prefill_and_decode_with_a_text_row_match_hf(vl):
    """A chunk ends inside the second image; a text-only prompt shares the steps; then decode
    steps at the prompt's offset positions (every stream at position + delta)."""
    path, hf, runner = vl
    extra = [80, 81, 82, 83]  # tokens the decode steps feed, as if sampled
    ids, images, mrope, runs = request(runner, path, 2, extra)
    text = prompt(0) + extra
    text_mrope = mrope_positions(text[:-len(extra)], [], IMAGE, 2)
    prompt_len = len(ids) - len(extra)
    cut = runs[1][0] + 3  # inside the second image's run
    a, b = Seq(runner, ids), Seq(runner, text)
    first = step(runner, [(a, cut, mrope, runs), (b, len(text) - len(extra), text_mrope, [])])
    second = step(runner, [(a, prompt_len - cut, mrope, runs), (b, 1, text_mrope, [])])
    decodes = [step(runner, [(a, 1, mrope, runs), (b, 1, text_mrope, [])]) for _ in range(3)]
    ref = hf_logits(hf, ids, images)
    text_ref = hf_logits(hf, text, [])
    ours = torch.cat([first[0], second[0], *(d[0] for d in decodes)])
    assert (ours - ref[: len(ours)]).abs().max() < TOL
    ours_text = torch.cat([first[1], second[1], *(d[1] for d in decodes)])
    assert (ours_text - text_ref[: len(ours_text)]).abs().max() < TOL


@pytest.mark.parametrize("n_images", [1, 2, 3])
def test_mrope_positions_and_decode_offset_match_hf(vl, n_images):
    path, hf, _ = vl
    ids, images = inputs(path, n_images)
    grids = [im.grid_thw for im in images]
    ours = mrope_positions(ids, grids, IMAGE, 2)
    ref, delta = hf.model.get_rope_index(torch.tensor([ids]),
                                         torch.tensor([[int(t == IMAGE) for t in ids]]),
                                         torch.tensor(grids))
    assert torch.equal(ours.prompt, ref[:, 0])
    assert ours.delta == int(delta) < 0
    # decode: token len(ids) + k sits at len(ids) + k + delta on every stream, as HF's generate
    after = ours.span(len(ids), len(ids) + 3)
    assert torch.equal(after, (torch.arange(len(ids), len(ids) + 3) + int(delta)).expand(3, -1))
    # a span across the end of the prompt joins both
    assert torch.equal(ours.span(len(ids) - 2, len(ids) + 1),
                       torch.cat((ref[:, 0, -2:], after[:, :1]), dim=1))


def test_expanded_and_unexpanded_ids_give_the_same_prompt(vl):
    path, _, _ = vl
    ids, images = inputs(path, 2)
    grids = [im.grid_thw for im in images]
    assert [ids.count(IMAGE)] == [sum(im.num_tokens(2) for im in images)]
    assert expand_image_tokens(ids, grids, IMAGE, 2) == ids
    with pytest.raises(ValueError, match="input_ids holds 2 image placeholder.* for 3 image"):
        expand_image_tokens(prompt(2), grids + [(1, 2, 2)], IMAGE, 2)
    bad = prompt(1)
    bad.insert(bad.index(IMAGE), IMAGE)  # a run of 2 for an image of more tokens
    with pytest.raises(ValueError, match="run of 2 placeholder tokens"):
        expand_image_tokens(bad, grids[:1], IMAGE, 2)
    with pytest.raises(ValueError, match="image 0: a run of 2 placeholder tokens"):
        mrope_positions(bad, grids[:1], IMAGE, 2)
    with pytest.raises(ValueError, match="placeholders for 2 of 3 image"):
        mrope_positions(ids, grids + [(1, 2, 2)], IMAGE, 2)
    with pytest.raises(ValueError, match="more image placeholder runs than the 1 image"):
        mrope_positions(ids, grids[:1], IMAGE, 2)


def test_checkpoint_and_trainer_names_both_load(vl):
    """transformers 5 saves Qwen2.5-VL in the older layout (visual.*, model.layers.*) and
    Qwen3-VL in the new one; a trainer's named_parameters use the new one: the engine takes
    every name, and the older ones are aliases of the same storage."""
    path, hf, runner = vl
    names = set(runner.weight_map)
    trainer_names = {n for n, _ in hf.named_parameters()}
    assert trainer_names <= names
    assert all(runner.weight_map[n].covers == () for n in trainer_names)
    older = {n.replace("model.language_model.", "model.", 1) if "language_model" in n
             else n.removeprefix("model.") for n in trainer_names if n.startswith("model.")}
    assert all(runner.weight_map[n].covers for n in older)
    visual = runner.weight_map["model.visual.blocks.0.attn.qkv.weight"].view
    assert torch.equal(visual, hf.model.visual.blocks[0].attn.qkv.weight)


def test_config_reads_the_vision_fields(vl):
    path, hf, runner = vl
    mcfg = runner.model_config
    assert mcfg.vision_token_ids == (IMAGE, 6, START, END)
    assert mcfg.mrope_section == (2, 3, 3)
    assert mcfg.mrope_interleaved == (hf.config.model_type == "qwen3_vl")
    assert (mcfg.hidden_size, mcfg.num_layers, mcfg.vocab_size) == (64, 2, hf.config.text_config
                                                                   .vocab_size)
    with pytest.raises(ValueError, match="tp_size=2: the vision tower is not split"):
        EngineConfig(model_path=path, tp_size=2).resolve(mcfg)
