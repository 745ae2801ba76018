"""Images through the adapters, on a tiny random Qwen2.5-VL: verl's server actor (the agent
loop's `image_data`), SGLang's Engine (`image_data`) and vLLM's LLM (`multi_modal_data`) give
what hotswap's own generate gives for the same prompt and image, and another image changes it."""

from __future__ import annotations

import asyncio
import random

import pytest
from fixtures import write_tiny_vl_model

from hotswap.engine import Engine
from hotswap.rollout.tasks import draw_shapes
from hotswap.trainers_adapters import sglang
from hotswap.trainers_adapters.verl.server import HotswapServer, ServerSettings
from hotswap.trainers_adapters.vllm import LLM, SamplingParams

START, IMAGE, END = 3, 5, 4  # the fixture tokenizer's vision_start, image_pad, vision_end
IDS = [1, 40, 41, START, IMAGE, END, 50, 51, 52]  # one placeholder: the engine expands it
PICTURES = [draw_shapes(2, 84, random.Random(0)), draw_shapes(3, 112, random.Random(1))]
NEW = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("vl-adapters"))
    write_tiny_vl_model(path, "qwen2_5_vl")
    return path


@pytest.fixture(scope="module")
def engine(model_path):
    engine = Engine(model_path, dtype="float32", seed=0, max_total_tokens=2048)
    yield engine
    engine.shutdown()


def native(engine: Engine, picture) -> tuple[list[int], list[float]]:
    out = engine.generate(None, {"max_new_tokens": NEW, "temperature": 0.0}, IDS,
                          image_data=[picture], return_logprob=True)
    return out["output_ids"], [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def reference(engine) -> list[tuple[list[int], list[float]]]:
    refs = [native(engine, picture) for picture in PICTURES]
    assert refs[0][1] != refs[1][1]  # the image matters to the output
    return refs


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= 1e-4 for a, b in zip(got, want))


def test_sglang_engine_passes_image_data(engine, reference):
    sgl = sglang.Engine(engine=engine)
    for picture, (ids, logprobs) in zip(PICTURES, reference):
        out = sgl.generate(None, {"max_new_tokens": NEW, "temperature": 0.0}, IDS,
                           image_data=[picture], return_logprob=True)
        assert out["output_ids"] == ids
        assert close([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], logprobs)
        assert out["meta_info"]["images"][0]["offset"] == IDS.index(IMAGE)


def test_vllm_llm_passes_multi_modal_data(engine, reference):
    llm = LLM(engine=engine)
    prompts = [{"prompt_token_ids": IDS, "multi_modal_data": {"image": p}} for p in PICTURES]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=0))
    for out, (ids, logprobs) in zip(outs, reference):
        (sample,) = out.outputs
        assert sample.token_ids == ids
        assert close([entry[t].logprob for entry, t in zip(sample.logprobs, ids)], logprobs)
    with pytest.raises(ValueError, match="only 'image'"):
        llm.generate([{"prompt_token_ids": IDS, "multi_modal_data": {"video": [PICTURES[0]]}}])


def test_verl_server_passes_the_agent_loops_image_data(model_path, engine, reference):
    """verl's agent loop sends the processor's expanded ids: the engine's own expansion here."""
    server = HotswapServer(ServerSettings(model_path, {"dtype": "float32",
                                                       "max_total_tokens": 2048}))
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True,
                "max_tokens": NEW}
    try:
        for picture, (ids, logprobs) in zip(PICTURES, reference):
            expanded = engine.generate(None, {"max_new_tokens": 1}, IDS, image_data=[picture])[
                "meta_info"]["prompt_ids"]
            assert len(expanded) > len(IDS)
            out = asyncio.run(server.generate(expanded, dict(sampling), "r0",
                                              image_data=[picture]))
            assert out.token_ids == ids and close(out.log_probs, logprobs)
        with pytest.raises(ValueError, match="video"):
            asyncio.run(server.generate(IDS, dict(sampling), "r1", video_data=[PICTURES[0]]))
    finally:
        server.shutdown()
