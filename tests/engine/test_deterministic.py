"""deterministic=True is batch-invariant: a seeded request's tokens and logprobs are the same
bits alone, among 63 random batch-mates at any position, under three prefill chunk sizes, after
a prefix-cache hit and after retraction, for a dense and an MoE tiny model in float32 and bf16.
(Without it, a row's matmul sums change order with the row count.)"""

from __future__ import annotations

import random

import pytest
import torch
from fixtures import write_moe, write_tiny_chat_model

from hotswap.engine import Engine
from hotswap.engine.layers import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs the CPU kernels")

COUNT, NEW = 32, 12
CHUNKS = (8, 24, 40)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model_path(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "llama":
        return write_tiny_chat_model(path, num_hidden_layers=3)
    return write_moe(path, "qwen3_moe", seed=3)


def requests(seed: int, count: int, seeded: bool) -> list[tuple[list[int], dict]]:
    """(prompt ids, sampling params): prompts of 20-90 tokens, temperature 1 with assorted
    truncation, seeded (the requests compared) or not (batch-mates)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        params = {"max_new_tokens": NEW if seeded else rng.randint(2, 24), "temperature": 1.0,
                  "ignore_eos": True}
        params.update(rng.choice([{}, {"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}]))
        if seeded:
            params["seed"] = 1000 + i
        out.append(([rng.randrange(3, 460) for _ in range(rng.randint(20, 90))], params))
    return out


def result(out: dict) -> tuple[list[int], list[float]]:
    return out["output_ids"], [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def make(path: str, dtype: str, **kwargs) -> Engine:
    return Engine(path, dtype=dtype, deterministic=True, max_total_tokens=16384, **kwargs)


def run(engine: Engine, reqs: list[tuple[list[int], dict]]) -> list[dict]:
    return engine.generate(input_ids=[ids for ids, _ in reqs],
                           sampling_params=[p for _, p in reqs], return_logprob=True)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def alone(model_path, dtype) -> list[tuple[list[int], list[float]]]:
    """Each seeded request run alone on a fresh engine (its prompt a cache miss), then once
    more (a hit: its whole prompt but the last token found in the cache), which must agree."""
    reqs = requests(0, COUNT, seeded=True)
    out = []
    with make(model_path, dtype) as engine:
        assert engine.runner.batch_invariant
        for ids, params in reqs:
            first = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
            again = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
            assert again["meta_info"]["cached_tokens"] >= len(ids) - 1
            assert result(again) == result(first)
            out.append(result(first))
    return out


def batch_of_64(seed: int) -> tuple[list[tuple[list[int], dict]], list[int]]:
    """The seeded requests among 32 random batch-mates, in a random order; the positions of
    the seeded ones."""
    mine = requests(0, COUNT, seeded=True)
    reqs = [(r, i) for i, r in enumerate(mine)] + [(r, None) for r in requests(seed, 32, False)]
    random.Random(seed).shuffle(reqs)
    where = [0] * COUNT
    for pos, (_, i) in enumerate(reqs):
        if i is not None:
            where[i] = pos
    return [r for r, _ in reqs], where


@pytest.mark.parametrize("chunk", [None, *CHUNKS])
def test_batch_and_chunks_equal_alone(model_path, dtype, alone, chunk):
    reqs, where = batch_of_64(seed=7 if chunk is None else chunk)
    kwargs = {} if chunk is None else {"chunked_prefill_size": chunk}
    with make(model_path, dtype, **kwargs) as engine:
        outs = run(engine, reqs)
        engine.check_integrity()
    for i in range(COUNT):
        assert result(outs[where[i]]) == alone[i], f"request {i} (batch position {where[i]})"


def test_retracted_equal_alone(model_path, dtype, alone):
    """Requests retracted mid-generation (their KV dropped or left to the cache) and resumed
    give the bits they give alone."""
    reqs, where = batch_of_64(seed=11)
    with make(model_path, dtype) as engine:
        stream = engine.generate(input_ids=[ids for ids, _ in reqs],
                                 sampling_params=[p for _, p in reqs], return_logprob=True,
                                 stream=True, rid=[f"r{i}" for i in range(len(reqs))])
        got: dict[str, tuple[list[int], list[float]]] = {}
        paused, retractions = 0, 0
        for event in stream:
            meta = event["meta_info"]
            ids, lps = got.setdefault(meta["id"], ([], []))
            ids += event["output_ids"]
            lps += [lp for lp, _ in meta["output_token_logprobs"]]
            if meta["finish_reason"] is not None:
                retractions += meta["num_retractions"]
            if paused < 2 and sum(len(v[0]) for v in got.values()) > 150 * (paused + 1):
                assert engine.pause_generation(mode="retract")["success"]
                assert engine.continue_generation()["success"]
                paused += 1
        assert paused == 2 and retractions > 0
        engine.check_integrity()
    for i in range(COUNT):
        assert got[f"r{where[i]}"] == alone[i], f"request {i}"


def test_greedy_matches_default_mode_closely(model_path):
    """The invariant kernels compute the same model: greedy tokens as the default mode's
    (float32), logprobs within float32 rounding."""
    ids, _ = requests(0, 1, seeded=True)[0]
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for deterministic in (True, False):
        with Engine(model_path, dtype="float32", deterministic=deterministic,
                    max_total_tokens=4096) as engine:
            outs.append(engine.generate(input_ids=ids, sampling_params=params,
                                        return_logprob=True))
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    a, b = (torch.tensor(result(o)[1]) for o in outs)
    assert torch.allclose(a, b, atol=1e-4)


def test_kv_written_by_decode_equals_kv_written_by_prefill(model_path, dtype):
    """A prompt that extends an earlier completion reads the KV its decode steps wrote (a cache
    hit past the earlier prompt) and continues with the bits of a fresh engine that prefills
    all of it."""
    ids, _ = requests(5, 1, seeded=True)[0]
    greedy = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    follow = {"max_new_tokens": 6, "temperature": 1.0, "seed": 9, "ignore_eos": True}
    with make(model_path, dtype) as engine:
        first = engine.generate(input_ids=ids, sampling_params=greedy)
        longer = ids + first["output_ids"][:12]
        warm = engine.generate(input_ids=longer, sampling_params=follow, return_logprob=True)
    assert warm["meta_info"]["cached_tokens"] >= len(ids) + 8  # decode-written KV, reused
    with make(model_path, dtype) as engine:
        cold = engine.generate(input_ids=longer, sampling_params=follow, return_logprob=True)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert result(warm) == result(cold)


def test_speculative_rows_equal_alone(model_path, dtype, alone):
    """Speculative decoding under deterministic=True: verify rows are decode rows of the same
    kernels, and the draft length (learnt from timings) changes only how many tokens a step
    emits, never their bits. (The self-draft drafts at every step; n-gram drafts verify in the
    same rows but random prompts give them little to find.)"""
    reqs, where = batch_of_64(seed=13)
    with make(model_path, dtype, speculative="self", speculative_self_layers=1) as engine:
        engine.scheduler.spec.lengths.choose = lambda batch: 3  # speculate on every step
        outs = run(engine, reqs)
        assert engine.scheduler.stats["spec_verify_steps"] > 0
        engine.check_integrity()
    for i in range(COUNT):
        assert result(outs[where[i]]) == alone[i], f"request {i}"
