"""Images in prompts through the whole engine (issue 53; docs/api.md#images): tiny random
Qwen2.5-VL and Qwen3-VL checkpoints written here, fp32, against Hugging Face transformers'
own models: greedy tokens and logprobs for 1-3 images, batches mixing image and text prompts,
a chunk boundary inside an image, expanded and unexpanded ids, chat parts; the prefix cache and
the encoder cache keyed by the images and retired by weight updates; bad inputs refused."""

from __future__ import annotations

import base64
import copy
import io
import os
import shutil

import httpx
import numpy as np
import pytest
import torch
from fixtures import serve, write_tiny_vl_model
from PIL import Image

from hotswap.engine import Engine
from hotswap.engine.client.remote import RemoteEngine
from hotswap.engine.models.qwen_vl import expand_image_tokens
from hotswap.engine.multimodal.image_processing import ImageProcessorConfig, process_images

TOL = 1e-4
IMAGE, START, END = 5, 3, 4  # the fixture tokenizer's <|image_pad|>, <|vision_start|>, _end|>
VISION = (3, 4, 5, 6)  # every vision token: never sampled
ARCHS = ["qwen2_5_vl", "qwen3_vl"]
SIZES = [(150, 90), (40, 70), (20, 20), (90, 60)]  # (width, height): grids that differ
NEW = 6


@pytest.fixture(scope="module", params=ARCHS)
def vl(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = write_tiny_vl_model(path, request.param)
    with Engine(path, dtype="float32", max_total_tokens=4096, attention_backend="torch") as eng:
        yield path, hf, eng


def pictures(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def prompt(n_images: int, tail: int = 0) -> list[int]:
    """Text around n unexpanded image placeholders."""
    ids = [1, 40, 41]
    for i in range(n_images):
        ids += [START, IMAGE, END, 50 + i, 60 + i]
    return ids + [70, 71, 72 + tail]


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@torch.no_grad()
def hf_greedy(hf, path: str, ids: list[int], images: list[Image.Image], count: int = NEW
              ) -> tuple[list[int], list[float], list[int]]:
    """HF's greedy continuation of the unexpanded `ids` with `images`, vision tokens masked as
    the engine masks them: (tokens, their logprobs, the expanded prompt)."""
    processed = process_images(images, ImageProcessorConfig.from_path(path))
    ids = expand_image_tokens(ids, [p.grid_thw for p in processed], IMAGE, 2)
    kw = {}
    if processed:
        kw = dict(pixel_values=torch.cat([p.pixel_values for p in processed]),
                  image_grid_thw=torch.tensor([p.grid_thw for p in processed]))
    seq, logprobs = list(ids), []
    for _ in range(count):
        types = torch.tensor([[int(t == IMAGE) for t in seq]])
        logits = hf(input_ids=torch.tensor([seq]), mm_token_type_ids=types, **kw).logits[0, -1]
        logits[list(VISION)] = -torch.inf
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits.double(), -1)[token]))
        seq.append(token)
    return seq[len(ids):], logprobs, ids


def greedy(eng: Engine, **kw) -> dict | list[dict]:
    return eng.generate(sampling_params={"max_new_tokens": NEW, "temperature": 0,
                                         "ignore_eos": True}, return_logprob=True, **kw)


def logprobs(out: dict) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def assert_matches(out: dict, ref: tuple[list[int], list[float], list[int]]) -> None:
    tokens, lps, ids = ref
    assert out["output_ids"] == tokens
    assert np.allclose(logprobs(out), lps, atol=TOL, rtol=0)
    assert out["meta_info"]["prompt_ids"] == ids


@pytest.mark.parametrize("n_images", [1, 2, 3])
def test_greedy_matches_hf_expanded_or_not(vl, n_images):
    path, hf, eng = vl
    images = pictures(SIZES[:n_images], seed=n_images)
    ref = hf_greedy(hf, path, prompt(n_images), images)
    eng.flush_cache()
    assert_matches(greedy(eng, input_ids=prompt(n_images), image_data=images), ref)
    eng.flush_cache()
    out = greedy(eng, input_ids=ref[2], image_data=images)  # verl's expanded ids
    assert_matches(out, ref)
    meta = out["meta_info"]["images"]
    grids = [p.grid_thw for p in process_images(images, ImageProcessorConfig.from_path(path))]
    assert [m["grid_thw"] for m in meta] == [list(g) for g in grids]
    assert all(ref[2][m["offset"]: m["offset"] + m["tokens"]] == [IMAGE] * m["tokens"]
               and ref[2][m["offset"] - 1] == START for m in meta)


def test_batch_mixes_image_and_text_prompts_and_image_forms(vl, tmp_path):
    path, hf, eng = vl
    images = pictures(SIZES[:3], seed=7)
    file = tmp_path / "picture.png"
    images[2].save(file)
    rows = [(prompt(2), images[:2]), (prompt(0, tail=5), []), (prompt(1, tail=3), [images[2]])]
    refs = [hf_greedy(hf, path, ids, ims) for ids, ims in rows]
    encoded = [[images[0], data_url(images[1])], None, [str(file)]]
    eng.flush_cache()
    outs = greedy(eng, input_ids=[ids for ids, _ in rows], image_data=encoded)
    for out, ref in zip(outs, refs):
        assert out["output_ids"] == ref[0]
        assert np.allclose(logprobs(out), ref[1], atol=TOL, rtol=0)
    assert "images" not in outs[1]["meta_info"]  # a text prompt says nothing of images


def test_chunk_boundary_inside_an_image(vl):
    path, hf, _ = vl
    images = pictures(SIZES[:2], seed=3)
    ref = hf_greedy(hf, path, prompt(2), images)
    first = ref[2].index(IMAGE)
    with Engine(path, dtype="float32", max_total_tokens=4096, attention_backend="torch",
                chunked_prefill_size=first + 4, page_size=4) as eng:
        out = greedy(eng, input_ids=prompt(2), image_data=images)
        assert_matches(out, ref)
        assert eng.get_load()["totals"]["encoder_runs"] == 2  # each image once over the chunks


def test_chat_image_parts_equal_the_token_path(vl):
    path, hf, eng = vl
    image = pictures([SIZES[0]], seed=11)[0]
    parts = [{"type": "text", "text": "what is"},
             {"type": "image_url", "image_url": {"url": data_url(image)}},
             {"type": "text", "text": " here?"}]
    eng.flush_cache()
    chat = greedy(eng, messages=[{"role": "user", "content": parts}])
    same = greedy(eng, messages=[{"role": "user", "content": [
        parts[0], {"type": "image", "image": image}, parts[2]]}])
    ids = eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": [parts[0], {"type": "image"}, parts[2]]}],
        tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    eng.flush_cache()
    tokens = greedy(eng, input_ids=ids, image_data=[image])
    ref = hf_greedy(hf, path, ids, [image])
    for out in (chat, same, tokens):
        assert_matches(out, ref)


def test_prefix_cache_is_keyed_by_the_image(vl):
    path, hf, eng = vl
    a, b = pictures([SIZES[0], SIZES[0]], seed=21)
    eng.flush_cache()
    first = greedy(eng, input_ids=prompt(1), image_data=[a])
    image = first["meta_info"]["images"][0]
    same = greedy(eng, input_ids=prompt(1), image_data=[a])
    assert same["meta_info"]["cached_tokens"] > image["offset"] + image["tokens"]
    assert same["output_ids"] == first["output_ids"]
    other = greedy(eng, input_ids=prompt(1), image_data=[b])  # same text, another image
    assert other["meta_info"]["cached_tokens"] <= image["offset"]
    assert_matches(other, hf_greedy(hf, path, prompt(1), [b]))
    # the same picture in another encoding is the same image: a hit
    again = greedy(eng, input_ids=prompt(1), image_data=[data_url(a)])
    assert again["meta_info"]["images"][0]["hash"] == image["hash"]
    assert again["meta_info"]["cached_tokens"] > image["offset"] + image["tokens"]


def test_a_match_never_ends_inside_an_image(vl):
    path, hf, _ = vl
    image = pictures([SIZES[0]], seed=5)
    expanded = hf_greedy(hf, path, prompt(1), image, count=1)[2]
    start, end = expanded.index(IMAGE), expanded.index(END)
    pad = [30] * ((2 - end) % 4)  # the image's run ends 2 tokens into a page of 4
    ids, start, end = pad + prompt(1), start + len(pad), end + len(pad)
    other = ids[: start + 1] + [80] + ids[start + 2:]  # the same image, then other text
    with Engine(path, dtype="float32", max_total_tokens=4096, attention_backend="torch",
                page_size=4) as eng:
        greedy(eng, input_ids=ids, image_data=image)
        out = greedy(eng, input_ids=other, image_data=image)
        # the tree matches up to the page holding the image's end; the match stops before it
        assert out["meta_info"]["cached_tokens"] == start - start % 4
        assert_matches(out, hf_greedy(hf, path, other, image))
        out = greedy(eng, input_ids=ids + [81] * 4, image_data=image)  # past the image: a hit
        assert out["meta_info"]["cached_tokens"] >= end + 1


def test_encoder_runs_once_per_image_and_weights(vl):
    path, _, eng = vl
    image = pictures([SIZES[1]], seed=31)
    runs = lambda: eng.get_load()["totals"]["encoder_runs"]  # noqa: E731
    eng.flush_cache()
    before = runs()
    outs = eng.generate(input_ids=prompt(1), image_data=image,
                        sampling_params={"max_new_tokens": 4, "temperature": 1.0, "n": 4})
    assert len(outs) == 4 and runs() == before + 1  # the group shares its leader's prefill
    eng.flush_cache()  # KV gone; the encoder cache too: a flush empties both
    greedy(eng, input_ids=prompt(1), image_data=image)
    hits = eng.get_load()["totals"]["encoder_hits"]
    # other text before the same image: no KV to share, the encoder's output is cached
    out = greedy(eng, input_ids=[1, 90] + prompt(1)[2:], image_data=image)
    assert out["meta_info"]["cached_tokens"] < out["meta_info"]["images"][0]["offset"]
    assert runs() == before + 2 and eng.get_load()["totals"]["encoder_hits"] == hits + 1


def perturbed(hf, seed: int, vision_only: bool = False, text_only: bool = False
              ) -> dict[str, torch.Tensor]:
    """The HF model's weights, changed: every tensor, or only the tower's or the text's."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in hf.state_dict().items():
        visual = "visual" in name
        if (vision_only and not visual) or (text_only and visual):
            continue
        out[name] = p + 0.02 * torch.randn(p.shape, generator=g)
    return out


@pytest.mark.parametrize("which", ["all", "language_model"])
def test_after_an_update_both_caches_miss_and_equal_a_fresh_engine(vl, tmp_path, which):
    path, hf, _ = vl
    images = pictures(SIZES[:2], seed=41)
    with Engine(path, dtype="float32", max_total_tokens=4096, attention_backend="torch") as eng:
        greedy(eng, input_ids=prompt(2), image_data=images)
        runs = eng.get_load()["totals"]["encoder_runs"]
        new = perturbed(hf, seed=1, text_only=which == "language_model")
        assert eng.update_weights_from_tensor(list(new.items()), weight_version="v1")["success"]
        out = greedy(eng, input_ids=prompt(2), image_data=images)
        assert out["meta_info"]["cached_tokens"] == 0
        assert eng.get_load()["totals"]["encoder_runs"] == runs + 2
        assert out["meta_info"]["weight_version"] == "v1"
    updated = copy.deepcopy(hf)
    updated.load_state_dict({**hf.state_dict(), **new})
    updated.save_pretrained(tmp_path)
    for name in os.listdir(path):  # tokenizer, image processor, generation config
        if not name.startswith(("model", "config")):
            shutil.copy(os.path.join(path, name), tmp_path / name)
    with Engine(str(tmp_path), dtype="float32", max_total_tokens=4096,
                attention_backend="torch") as fresh:
        ref = greedy(fresh, input_ids=prompt(2), image_data=images)
    assert out["output_ids"] == ref["output_ids"]
    assert np.allclose(logprobs(out), logprobs(ref), atol=1e-5, rtol=0)


def test_vision_tokens_are_never_sampled(vl):
    _, _, eng = vl
    favoured = {t: 50.0 for t in VISION}
    out = eng.generate(input_ids=prompt(1), image_data=pictures([SIZES[2]]),
                       sampling_params={"max_new_tokens": 8, "temperature": 1.0, "seed": 3,
                                        "ignore_eos": True, "logit_bias": favoured})
    assert len(out["output_ids"]) == 8 and not set(out["output_ids"]) & set(VISION)


BAD = [
    (dict(input_ids=prompt(1), image_data=[b"not an image"]), "image_data[0]"),
    (dict(input_ids=prompt(1), image_data=[b""]), "image_data[0]"),
    (dict(input_ids=prompt(2), image_data=[data_url(Image.new("RGB", (30, 30)))]), "input_ids"),
    (dict(input_ids=prompt(1)), "input_ids"),
    (dict(input_ids=prompt(1), image_data=["https://example.com/cat.png"]), "image_data[0]"),
    (dict(input_ids=prompt(1), image_data=[data_url(Image.new("RGB", (9000, 8000)), "PNG")]),
     "image_data[0]"),
]


@pytest.mark.parametrize("kw,field", BAD, ids=["undecodable", "empty", "placeholders",
                                                "no-image", "url", "too-large"])
def test_bad_images_are_refused_naming_the_field(vl, kw, field):
    _, _, eng = vl
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        greedy(eng, **kw)
    ok = greedy(eng, input_ids=prompt(1), image_data=pictures([SIZES[2]]))
    assert len(ok["output_ids"]) == NEW


def test_an_image_on_a_text_only_model_is_refused(tiny_chat_model_path):
    with Engine(tiny_chat_model_path, dtype="float32", max_total_tokens=1024) as eng:
        with pytest.raises(ValueError, match="image_data: .*text-only"):
            eng.generate(input_ids=[1, 2, 3], image_data=pictures([(20, 20)]))
        assert eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})


def test_http_routes_take_images_and_refuse_bad_ones(vl):
    path, hf, eng = vl
    image = pictures([SIZES[0]], seed=51)[0]
    ref = hf_greedy(hf, path, prompt(1), [image])
    params = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    with serve(eng) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        eng.flush_cache()
        native = http.post("/generate", json={"input_ids": prompt(1), "image_data": [
            data_url(image)], "sampling_params": params, "return_logprob": True}).json()
        assert_matches(native, ref)
        for bad in ([base64.b64encode(b"junk").decode()], ["data:image/png,raw"], []):
            r = http.post("/generate", json={"input_ids": prompt(1), "image_data": bad,
                                             "sampling_params": params})
            assert r.status_code == 400, r.text
            assert "image_data" in r.text or "input_ids" in r.text
        chat = http.post("/v1/chat/completions", json={
            "model": eng.config.served_model_name, "max_tokens": 4, "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": data_url(image)}}]}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] > 20  # the image's tokens are in
        r = http.post("/v1/chat/completions", json={
            "model": eng.config.served_model_name, "max_tokens": 4, "messages": [
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
        assert r.status_code == 400 and "image_data[0]" in r.text
        native = http.post("/generate", json={"input_ids": prompt(1), "image_data": [
            data_url(image)], "sampling_params": params, "return_logprob": True}).json()
        assert native["output_ids"] == ref[0]  # still serving
        remote = RemoteEngine(srv.url).generate(input_ids=prompt(1), image_data=[image],
                                                sampling_params=params, return_logprob=True)
        assert_matches(remote, ref)  # a PIL image travels as a PNG data URL


def test_remote_body_carries_images_as_strings(tmp_path):
    from hotswap.engine.client.request import GenerateRequest

    image = pictures([(30, 20)])[0]
    file = tmp_path / "x.png"
    image.save(file)
    body = GenerateRequest(input_ids=[[1, 5], [1, 5]],
                           image_data=[[image], [str(file)]]).body()
    sent = body["image_data"]
    assert sent[0][0].startswith("data:image/png;base64,") and isinstance(sent[1][0], str)
    cfg = ImageProcessorConfig()
    hashes = [p.hash for p in process_images([image, sent[0][0], sent[1][0]], cfg)]
    assert len(set(hashes)) == 1


def test_image_data_shapes():
    from hotswap.engine.client.request import GenerateRequest

    image = pictures([(30, 20)])[0]
    rows, single = GenerateRequest(input_ids=[1, 5], image_data=image).split()
    assert single and rows[0].image_data == [image]
    rows, _ = GenerateRequest(input_ids=[[1, 5], [1]], image_data=[[image, image], None]).split()
    assert rows[0].image_data == [image, image] and rows[1].image_data is None
    with pytest.raises(ValueError, match="image_data must be a list of 2"):
        GenerateRequest(input_ids=[[1, 5], [1]], image_data=[image]).split()


def test_prefill_decode_handoff_carries_the_images(vl):
    path, hf, _ = vl
    a, b = pictures([SIZES[0], SIZES[0]], seed=61)
    params = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    kw = dict(dtype="float32", max_total_tokens=4096, attention_backend="torch")
    with Engine(path, role="prefill", **kw) as pre, Engine(path, role="decode", **kw) as dec:
        first = pre.prefill(input_ids=prompt(1), image_data=[a], sampling_params=params,
                            return_logprob=True)
        out = dec.generate_from_handoff(first, params, image_data=[a], return_logprob=True)
        assert out["meta_info"]["kv_handoff"]["accepted"]
        assert dec.get_load()["totals"]["encoder_runs"] == 0  # the KV came whole
        assert_matches(out, hf_greedy(hf, path, prompt(1), [a]))
        first = pre.prefill(input_ids=prompt(1), image_data=[a], sampling_params=params,
                            return_logprob=True)
        out = dec.generate_from_handoff(first, params, image_data=[b], return_logprob=True)
        handoff = out["meta_info"]["kv_handoff"]
        assert not handoff["accepted"] and "images differ" in handoff["reason"]
        # the first token came from image a's prefill; the rest is computed here with b
        ref = hf_greedy(hf, path, prompt(1), [b])
        expanded = ref[2] + out["output_ids"][:1]
        rest = hf_greedy(hf, path, prompt(1) + out["output_ids"][:1], [b], count=NEW - 1)
        assert out["output_ids"][1:] == rest[0] and expanded[:-1] == ref[2]
        assert np.allclose(logprobs(out)[1:], rest[1], atol=TOL, rtol=0)


def test_a_bad_vision_tensor_refuses_the_whole_update(vl):
    path, hf, eng = vl
    images = pictures([SIZES[1]], seed=71)
    before = greedy(eng, input_ids=prompt(1), image_data=images)
    new = perturbed(hf, seed=2)
    name = next(n for n in new if "visual" in n and n.endswith("weight"))
    new[name] = new[name][..., :-1]  # the wrong shape
    with pytest.raises(ValueError, match="visual"):
        eng.update_weights_from_tensor(list(new.items()), weight_version="bad")
    after = greedy(eng, input_ids=prompt(1), image_data=images)
    assert after["output_ids"] == before["output_ids"]
    assert logprobs(after) == logprobs(before)
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
