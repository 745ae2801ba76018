"""Speculative decoding: drafts change how many forwards run, never what is emitted.

References: the same engine options without speculation (greedy: token for token, logprobs
within 1e-5; seeded sampling: the same tokens, since a verify position draws with the uniform
of the step it samples), a chi-square test of the emitted distribution against plain sampling
that a wrong accept rule fails, and a fresh engine on the new weights after an update.
The draft length is pinned per test (`pin_length`): the engine's own choice follows measured
step times, which on these tiny models may well be "do not speculate".
"""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
import torch
from conftest import write_tiny_chat_model
from torchrun_sender import perturbed, save_checkpoint

from hotswap.engine import Engine
from hotswap.engine.core.sampling_params import SamplingParams
from hotswap.engine.speculative import lengths as lengths_module
from hotswap.engine.speculative.ngram import NgramIndex

LAYERS = 4
# Prompts that repeat themselves, so n-gram drafts exist from the first step.
PROMPTS = [[510, 2100, 33, 910, 77] * 4, [4000, 4001, 4002] * 5 + [4000], list(range(300, 340)),
           [12, 13, 14, 15, 16, 12, 13, 14]]
DRAFTS = {"ngram": {"speculative": "ngram"},
          "self": {"speculative": "self", "speculative_self_layers": LAYERS - 1}}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("spec")), num_hidden_layers=LAYERS)


def make_engine(path: str, **kwargs) -> Engine:
    return Engine(path, **{"dtype": "float32", "max_total_tokens": 8192, **kwargs})


def pin_length(engine: Engine, length: int) -> None:
    engine.scheduler.spec.lengths.choose = lambda batch: length


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def logprobs(out: dict) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def generate(engine: Engine, prompts: list[list[int]], params: dict | list[dict]) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                           top_logprobs_num=3)


@pytest.fixture(scope="module")
def plain_greedy(model_path) -> list[dict]:
    with make_engine(model_path) as engine:
        return generate(engine, PROMPTS, greedy(48))


@pytest.mark.parametrize("kind", sorted(DRAFTS))
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_equals_plain(model_path, plain_greedy, kind, page_size):
    with make_engine(model_path, page_size=page_size, **DRAFTS[kind]) as engine:
        pin_length(engine, 4)
        outs = generate(engine, PROMPTS, greedy(48))
        totals = engine.get_load()["totals"]
        engine.check_integrity()  # rejected drafts' KV went back to the pool
    for got, ref in zip(outs, plain_greedy, strict=True):
        assert got["output_ids"] == ref["output_ids"]
        assert max(abs(a - b) for a, b in zip(logprobs(got), logprobs(ref))) <= 1e-5
        tops = zip(got["meta_info"]["output_top_logprobs"], ref["meta_info"]["output_top_logprobs"])
        for a, b in tops:
            assert [t for _, t in a] == [t for _, t in b]
        assert got["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 48}]
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    kept = sum(o["meta_info"]["spec_accepted_tokens"] for o in outs)
    assert verify == totals["spec_verify_steps"] > 0 and kept == totals["spec_accepted_tokens"]
    assert kept > 0  # drafts were kept: fewer steps than tokens
    assert totals["spec_draft_tokens"] > kept or kind == "ngram"


def test_radix_cache_holds_verified_tokens_only(model_path, plain_greedy):
    """After speculative requests finish, a prompt that extends one of their outputs finds it
    in the cache with exactly the verified tokens' KV: its greedy continuation is the plain
    engine's."""
    prompt = PROMPTS[0] + plain_greedy[0]["output_ids"][:40]
    with make_engine(model_path) as engine:
        ref = generate(engine, [prompt], greedy(8))[0]
    with make_engine(model_path, **DRAFTS["ngram"]) as engine:
        pin_length(engine, 6)
        generate(engine, PROMPTS[:1], greedy(48))
        got = generate(engine, [prompt], greedy(8))[0]
        engine.check_integrity()
    assert got["meta_info"]["cached_tokens"] >= len(PROMPTS[0]) + 39
    assert got["output_ids"] == ref["output_ids"]
    assert max(abs(a - b) for a, b in zip(logprobs(got), logprobs(ref))) <= 1e-5


SAMPLED = [{"temperature": 0.8, "top_p": 0.9, "seed": 3},
           {"temperature": 1.0, "top_k": 20, "frequency_penalty": 0.5, "seed": 4},
           {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.3, "seed": 5},
           {"temperature": 1.0, "presence_penalty": 1.0, "logit_bias": {"77": 5.0}, "seed": 6,
            "min_new_tokens": 20, "logprob_mode": "raw"},
           # nearly greedy: the tiny model loops, so n-gram drafts exist and are kept
           {"temperature": 0.2, "seed": 7}, {"temperature": 0.3, "top_k": 5, "seed": 8}]


@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_seeded_sampling_equals_plain(model_path, kind):
    """Each verify position draws with its own step's seeded uniform from the distribution
    plain decoding uses there (penalties over the drafts before it): the same tokens."""
    params = [{**p, "max_new_tokens": 32} for p in SAMPLED]
    with make_engine(model_path) as engine:
        ref = generate(engine, PROMPTS + PROMPTS[:2], params)
    with make_engine(model_path, **DRAFTS[kind]) as engine:
        pin_length(engine, 3)
        got = generate(engine, PROMPTS + PROMPTS[:2], params)
        engine.check_integrity()
    for a, b in zip(got, ref, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert max(abs(x - y) for x, y in zip(logprobs(a), logprobs(b))) <= 1e-5
    assert sum(o["meta_info"]["spec_accepted_tokens"] for o in got) > 0


def test_opt_out_and_grammar_rows_do_not_speculate(model_path):
    with make_engine(model_path, **DRAFTS["ngram"]) as engine:
        pin_length(engine, 4)
        outs = engine.generate(input_ids=PROMPTS[:2], sampling_params=[
            {**greedy(16), "speculative": False}, {**greedy(16), "regex": "[ab]{16}"}])
    assert [o["meta_info"]["spec_verify_ct"] for o in outs] == [0, 0]
    assert re.fullmatch("[ab]{16}", outs[1]["text"])
    with pytest.raises(ValueError, match="sampling_params.speculative"):
        SamplingParams(speculative="yes")


@pytest.mark.parametrize("options, match", [
    ({"speculative": "eagle"}, "speculative must be one of"),
    ({"speculative": "draft"}, "missing file"),
    ({"speculative": "ngram", "speculative_num_draft_tokens": 0}, "speculative_num_draft"),
    ({"speculative": "ngram", "speculative_self_layers": 2}, "speculative_self_layers"),
    ({"speculative": "self", "speculative_self_layers": LAYERS}, "speculative_self_layers")])
def test_bad_options_refused(model_path, options, match):
    with pytest.raises(ValueError, match=match):
        make_engine(model_path, **options)


# The emitted distribution: many independently seeded samples of one prompt, with and without
# speculation, compared by a chi-square test of homogeneity over the third token. A model with a
# 64-token vocabulary, so the categories are well filled.

SAMPLES = 3000
TEMPERATURE = 0.5


@pytest.fixture(scope="module")
def small_vocab_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("spec64")),
                                 num_hidden_layers=LAYERS, vocab_size=64)


def chi_square_p(a: Counter, b: Counter, min_count: int = 10) -> float:
    """p-value of homogeneity of two samples' categories (rare ones pooled)."""
    cats = [c for c in set(a) | set(b) if a[c] + b[c] >= min_count]
    rows = torch.tensor([[a[c] for c in cats] + [sum(a.values()) - sum(a[c] for c in cats)],
                         [b[c] for c in cats] + [sum(b.values()) - sum(b[c] for c in cats)]],
                        dtype=torch.float64)
    rows = rows[:, rows.sum(0) > 0]
    expected = rows.sum(1, keepdim=True) * rows.sum(0, keepdim=True) / rows.sum()
    stat = ((rows - expected) ** 2 / expected).sum()
    df = rows.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def third_tokens(engine: Engine, seeds: range) -> Counter:
    params = [{"max_new_tokens": 4, "temperature": TEMPERATURE, "ignore_eos": True, "seed": s}
              for s in seeds]
    outs = engine.generate(input_ids=[[40, 41, 42] * 5] * len(seeds), sampling_params=params)
    return Counter(o["output_ids"][2] for o in outs)


@pytest.fixture(scope="module")
def plain_samples(small_vocab_path) -> Counter:
    with make_engine(small_vocab_path, max_running_requests=256) as engine:
        return third_tokens(engine, range(SAMPLES, 2 * SAMPLES))


def keep_every_draft(draft: list[int], draws: list[int]) -> int:
    """A wrong rule: the draws are emitted without checking the drafts they were drawn after."""
    return len(draft)


@pytest.mark.parametrize("rule", [None, keep_every_draft])
def test_emitted_distribution_is_the_targets(small_vocab_path, plain_samples, monkeypatch,
                                             rule):
    """The right rule keeps the third token's distribution within p = 1e-3 of plain sampling's
    (measured: p = 0.3); emitting draws drawn after unchecked drafts moves it far past (3.6e-5)."""
    if rule is not None:
        monkeypatch.setattr("hotswap.engine.scheduler.step_outputs.accepted_length", rule)
    with make_engine(small_vocab_path, max_running_requests=256, **DRAFTS["self"]) as engine:
        pin_length(engine, 2)
        got = third_tokens(engine, range(SAMPLES))
        kept = engine.get_load()["totals"]["spec_accepted_tokens"]
    p = chi_square_p(got, plain_samples)
    assert kept > SAMPLES // 10
    if rule is None:
        assert p > 1e-3
    else:
        assert p < 1e-3


# Weight updates while speculative requests run.

@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_update_mid_generation(model_path, plain_greedy, tmp_path, mode, kind):
    v1 = perturbed(model_path, seed=1)
    v1_path = save_checkpoint(v1, model_path, str(tmp_path / "v1"))
    with make_engine(model_path, **DRAFTS[kind]) as engine:
        pin_length(engine, 3)
        stream = engine.generate(input_ids=PROMPTS, sampling_params=greedy(48), stream=True,
                                 rid=[f"r{i}" for i in range(len(PROMPTS))])
        ids: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        finals, reply = {}, None
        for event in stream:
            meta = event["meta_info"]
            ids[meta["id"]] += event["output_ids"]
            if meta["finish_reason"] is not None:
                finals[meta["id"]] = meta
            if reply is None and all(len(v) >= 6 for v in ids.values()):
                reply = engine.update_weights_from_tensor(v1, weight_version="v1",
                                                          pause_mode=mode)
        assert reply["success"] and len(finals) == len(PROMPTS)
        engine.check_integrity()
        draft_check = draft_argmax(engine) if kind == "self" else None
    for i in range(len(PROMPTS)):
        out, meta = ids[f"r{i}"], finals[f"r{i}"]
        spans = meta["weight_versions"]
        assert spans[0]["version"] == "0" and spans[0]["start"] == 0
        old = spans[0]["end"]
        assert out[:old] == plain_greedy[i]["output_ids"][:old]  # v0's tokens are v0's
        if mode == "abort":
            assert meta["finish_reason"]["type"] == "abort" and len(spans) == 1
            continue
        assert [s["version"] for s in spans] == ["0", "v1"]
        assert spans[1]["start"] == old and spans[1]["end"] == len(out) == 48
        if mode == "retract":  # recomputed on v1: a fresh v1 engine continues the same way
            with make_engine(v1_path) as fresh:
                cont = fresh.generate(input_ids=PROMPTS[i] + out[:old],
                                      sampling_params=greedy(48 - old))
            assert out[old:] == cont["output_ids"]
    if draft_check is not None:
        with make_engine(v1_path, **DRAFTS["self"]) as fresh:
            assert torch.equal(draft_check, draft_argmax(fresh))


def draft_argmax(engine: Engine) -> torch.Tensor:
    """The self-draft's argmax at every position of a fixed sequence (scratch KV)."""
    sd = engine.scheduler.spec.self_draft
    runner = sd.runner

    def on_thread() -> torch.Tensor:
        row, slots = runner.req_to_token_pool.alloc(), runner.allocator.alloc(24)
        runner.req_to_token_pool.write(row, 0, slots)
        try:
            return sd._argmax([list(range(100, 124))], [row], slots, sd.layers)[0]
        finally:
            runner.allocator.free(slots)
            runner.req_to_token_pool.free(row)

    return engine.scheduler.run(on_thread)


# Units: the n-gram index and the draft-length choice.

def test_ngram_index_proposes_latest_continuation():
    index = NgramIndex()
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert index.propose(tokens, 3) == [7, 8, 5]  # the latest earlier "1 2 3"
    assert index.propose(tokens + [4], 3) == []  # "3 4" never seen
    grown = tokens + [4, 1, 2]
    assert index.propose(grown, 2) == [3, 4]  # "4 1 2" ... longest match first
    assert NgramIndex().propose([5, 6, 5, 6], 0) == []


def test_draft_lengths_stop_exploring_where_speculation_does_not_pay():
    lengths = lengths_module.DraftLengths(8)
    rng = random.Random(0)
    chosen = []
    for _ in range(6000):  # a large batch: every drafted token costs about a token
        d = lengths.choose(64)
        chosen.append(d)
        kept = sum(rng.random() < 0.5 ** (j + 1) for j in range(d))
        lengths.record(64, d, 64 * (1 + kept), 0.01 * (1 + 0.9 * d) * rng.uniform(0.9, 1.1))
    assert lengths.best(64) == 0
    assert set(chosen) == {0, 1}  # length 1 lost: nothing longer was tried
    assert chosen.count(1) < 0.01 * len(chosen)  # probes, less often as they keep losing


def test_draft_lengths_find_the_best_length():
    lengths = lengths_module.DraftLengths(8)
    rng = random.Random(1)
    for _ in range(600):  # batch 1: a few more tokens cost little; drafts kept with p = 0.8
        d = lengths.choose(1)
        kept = 0
        while kept < d and rng.random() < 0.8:
            kept += 1
        lengths.record(1, d, 1 + kept, 0.01 * (1 + 0.08 * d) * rng.uniform(0.95, 1.05))
    assert lengths.best(1) in (4, 8)  # expected tokens per second peak at 4-6


@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_moe_routes_are_the_emitted_tokens(tmp_path, kind):
    """A MoE model: speculative greedy equals plain, and the routed experts returned are those
    of the positions fed for emitted tokens (prompt + completion - 1 rows), the same as plain."""
    from fixtures import write_moe

    path = write_moe(str(tmp_path / "moe"), "qwen3_moe", 0)
    options = {"enable_return_routed_experts": True, "device": "cpu"}
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44]]

    def run(**kwargs) -> list[dict]:
        with make_engine(path, **options, **kwargs) as engine:
            if kwargs:
                pin_length(engine, 3)
            return engine.generate(input_ids=prompts, sampling_params=greedy(24),
                                   return_logprob=True, return_routed_experts=True)

    ref = run()
    got = run(**{**DRAFTS[kind], "speculative_self_layers": 1} if kind == "self"
              else DRAFTS[kind])
    for a, b in zip(got, ref, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert max(abs(x - y) for x, y in zip(logprobs(a), logprobs(b))) <= 1e-5
        routes = a["meta_info"]["routed_experts"]
        assert routes.shape[0] == len(prompts[got.index(a)]) + 24 - 1
        assert (routes == b["meta_info"]["routed_experts"]).all()
    assert sum(o["meta_info"]["spec_verify_ct"] for o in got) > 0


@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_lora_requests_speculate_with_their_adapter(model_path, tmp_path, kind):
    """A request with an adapter drafts (self-draft: through the adapter in its layers) and is
    verified with it: greedy equals plain, beside a base-model request in the same batch."""
    pytest.importorskip("peft")
    from fixtures import save_random_lora

    save_random_lora(model_path, str(tmp_path / "adapter"),
                     ["q_proj", "v_proj", "gate_proj", "down_proj"])

    def run(**kwargs) -> list[dict]:
        with make_engine(model_path, **kwargs) as engine:
            engine.load_lora_adapter("a", str(tmp_path / "adapter"))
            if kwargs:
                pin_length(engine, 3)
            return engine.generate(input_ids=PROMPTS[:2], sampling_params=greedy(32),
                                   lora_name=["a", None], return_logprob=True)

    ref, got = run(), run(**DRAFTS[kind])
    for a, b in zip(got, ref, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert max(abs(x - y) for x, y in zip(logprobs(a), logprobs(b))) <= 1e-5
    assert got[0]["meta_info"]["spec_verify_ct"] > 0
    assert got[0]["meta_info"]["adapter_version"] == 1


def test_http_generate_and_metrics(model_path):
    """Over HTTP: a request opts out with sampling_params.speculative, others speculate, and
    /metrics counts verify steps and kept drafts."""
    import httpx
    from fixtures import serve

    with make_engine(model_path, **DRAFTS["ngram"]) as engine, serve(engine) as server:
        pin_length(engine, 4)
        replies = [httpx.post(f"{server.url}/generate", timeout=60, json={
            "input_ids": PROMPTS[0], "sampling_params": {**greedy(24), "speculative": s}})
            for s in (True, False)]
        bad = httpx.post(f"{server.url}/generate", timeout=60, json={
            "input_ids": PROMPTS[0], "sampling_params": {**greedy(4), "speculative": 1}})
        text = httpx.get(f"{server.url}/metrics").text
    metas = [r.json()["meta_info"] for r in replies]
    assert metas[0]["spec_verify_ct"] > 0 and metas[1]["spec_verify_ct"] == 0
    assert replies[0].json()["output_ids"] == replies[1].json()["output_ids"]
    assert bad.status_code == 400 and "speculative" in bad.text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("hotswap_spec")}
    assert values["hotswap_spec_verify_steps_total"] == metas[0]["spec_verify_ct"]
    assert values["hotswap_spec_accepted_tokens_total"] == metas[0]["spec_accepted_tokens"]
    assert values["hotswap_spec_accept_length"] == pytest.approx(
        metas[0]["spec_accepted_tokens"] / metas[0]["spec_verify_ct"])
