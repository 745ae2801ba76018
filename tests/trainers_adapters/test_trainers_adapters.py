"""hotswap.trainers_adapters in process: SGLang's Engine, vLLM's LLM and the group helpers, on one
tiny random Llama engine (verl: test_verl.py; OpenRLHF: test_openrlhf_actor.py)."""

from __future__ import annotations

import pytest
import torch
from fixtures import write_tiny_chat_model

from hotswap.engine import Engine
from hotswap.trainers_adapters import sglang
from hotswap.trainers_adapters.groups import init_custom_process_group
from hotswap.trainers_adapters.vllm import LLM, SamplingParams

IDS = [5, 9, 33, 40, 7, 12]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_chat_model(str(tmp_path_factory.mktemp("adapters")))
    with Engine(path, max_total_tokens=4096) as e:
        yield e


def moved(e: Engine, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, s.view.detach() + 0.05 * torch.randn(s.view.shape, generator=gen))
            for n, s in e.runner.weight_map.items()]


def greedy_ids(e: Engine) -> list[int]:
    return e.generate(None, GREEDY, IDS)["output_ids"]


def test_sglang_engine_generate_in_sglang_order_and_shapes(engine):
    sgl = sglang.Engine(engine=engine)
    # Both calls start from an empty prefix cache, so they compute the same way (a cached
    # prompt rounds differently in the last bits).
    assert engine.flush_cache()["success"]
    out = sgl.generate(None, {"max_new_tokens": 5, "sampling_seed": 3, "temperature": 1.0,
                              "spaces_between_special_tokens": False}, IDS, return_logprob=True)
    assert engine.flush_cache()["success"]
    native = engine.generate(None, {"max_new_tokens": 5, "seed": 3, "temperature": 1.0}, IDS,
                             return_logprob=True)
    assert out["output_ids"] == native["output_ids"]
    for (lp, tid, text), (nlp, ntid) in zip(out["meta_info"]["output_token_logprobs"],
                                             native["meta_info"]["output_token_logprobs"]):
        assert (lp, tid, text) == (nlp, ntid, None)
    with pytest.raises(ValueError, match="text-only model"):  # image_data reaches the engine
        sgl.generate(None, GREEDY, IDS, image_data=["x.png"])
    with pytest.raises(ValueError, match="not supported by hotswap: bootstrap_host"):
        sgl.generate(None, GREEDY, IDS, bootstrap_host="h")


def first_stop_string(text: str) -> str | None:
    """Two visible characters from the second half of `text`, taken where they first occur."""
    for i in range(len(text) // 2, len(text) - 1):
        window = text[i:i + 2]
        if window.strip() and "\ufffd" not in window and text.find(window) == i:
            return window
    return None


def test_sglang_no_stop_trim_keeps_the_stop_string(engine):
    sgl = sglang.Engine(engine=engine)
    params = {**GREEDY, "max_new_tokens": 24, "skip_special_tokens": False}
    text = engine.generate(None, params, IDS)["text"]
    # The stop string is one the model really produces, so greedy decoding reaches it.
    stop = first_stop_string(text)
    assert stop is not None, text
    before = text[:text.index(stop)]
    trimmed = sgl.generate(None, {**params, "stop": stop}, IDS)
    kept = sgl.generate(None, {**params, "stop": stop, "no_stop_trim": True}, IDS)
    reason = trimmed["meta_info"]["finish_reason"]
    assert (reason["type"], reason["matched"]) == ("stop", stop)
    assert trimmed["text"] == before
    assert kept["text"] == before + stop


def test_sglang_buckets_with_flush_cache_false_commit_once_at_flush(engine):
    sgl = sglang.Engine(engine=engine)
    start = int(engine.get_weight_version())
    weights = moved(engine, seed=1)
    for i in range(0, len(weights), 4):
        ok, message = sgl.update_weights_from_tensor(weights[i:i + 4], flush_cache=False)
        assert ok and "staged" in message
        assert engine.get_weight_version() == str(start)
    sgl.flush_cache()
    assert engine.get_weight_version() == str(start + 1)
    # The same weights as a slime FlattenedTensorBucket, in one committed call: no change.
    before = greedy_ids(engine)
    flat = torch.cat([t.reshape(-1) for _, t in weights])
    metadata, offset = [], 0
    for name, t in weights:
        metadata.append({"name": name, "shape": t.shape, "dtype": t.dtype, "start_idx": offset,
                         "end_idx": offset + t.numel(), "numel": t.numel()})
        offset += t.numel()
    ok, _ = sgl.update_weights_from_tensor({"flattened_tensor": flat, "metadata": metadata},
                                           load_format="flattened_bucket")
    assert ok and engine.get_weight_version() == str(start + 2)
    assert greedy_ids(engine) == before


def test_sglang_server_args_are_mapped_or_refused(tmp_path):
    with pytest.raises(ValueError, match="enable_dp_attention"):
        sglang.Engine(model_path=str(tmp_path), enable_dp_attention=True)
    kwargs = sglang._engine_kwargs({"model_path": "m", "random_seed": 3, "log_level": "error",
                                    "disable_radix_cache": True, "mem_fraction_static": 0.5,
                                    "tp_size": 2})
    assert kwargs == {"model_path": "m", "seed": 3, "enable_prefix_cache": False,
                      "mem_fraction": 0.5, "tp_size": 2}


def test_vllm_llm_generate_with_token_prompts_and_load_weights(engine):
    llm = LLM(engine=engine)
    params = SamplingParams(n=2, temperature=1.0, top_k=0, max_tokens=4, logprobs=1, seed=9)
    outs = llm.generate([{"prompt_token_ids": IDS}, {"prompt_token_ids": IDS[:3]}], params,
                        use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2]
    assert outs[0].prompt_token_ids == IDS
    sample = outs[0].outputs[0]
    assert len(sample.token_ids) == 4 and len(sample.logprobs) == 4
    for tid, entry in zip(sample.token_ids, sample.logprobs):
        assert tid in entry and 1 <= len(entry) <= 2  # the sampled token, plus the top 1
    assert sample.finish_reason == "length"
    start = int(engine.get_weight_version())
    llm.load_weights(moved(engine, seed=2))
    assert engine.get_weight_version() == str(start)
    assert llm.reset_prefix_cache()
    assert engine.get_weight_version() == str(start + 1)


@pytest.mark.slow
def test_vllm_tensor_parallel_size_runs_the_engine_over_that_many_ranks(engine):
    path = engine.config.model_path  # the fixture's checkpoint (its engine's weights moved)
    with Engine(path, max_total_tokens=4096) as one:
        want = greedy_ids(one)
    llm = LLM(path, tensor_parallel_size=2)
    try:
        assert llm.engine.config.tp_size == 2 and len(llm.engine.runner.workers) == 1
        assert greedy_ids(llm.engine) == want
    finally:
        llm.engine.shutdown()


def test_group_helper_rejects_what_hotswap_cannot_join():
    with pytest.raises(ValueError, match="init_method"):
        init_custom_process_group(backend="gloo", init_method="env://", world_size=2, rank=0,
                                  group_name="g")
    with pytest.raises(ValueError, match="group_name"):
        init_custom_process_group(backend="gloo", init_method="tcp://127.0.0.1:1",
                                  world_size=2, rank=0)
