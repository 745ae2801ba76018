"""Grammar-constrained decoding on tiny random models with SmolLM2's tokenizer (engine/grammar).

Random weights make the unconstrained choice arbitrary, so every output here is shaped by the
grammar alone: what must hold is that it always matches, finishes as documented, and leaves the
unconstrained rows of the same batch exactly as they are alone.
"""

from __future__ import annotations

import math
import re
import threading

import pytest
import torch
import xgrammar as xgr
from safetensors.torch import load_file

from hotswap.engine import Engine
from hotswap.engine.executor.sampling_batch_info import apply_token_bitmask
from hotswap.engine.grammar.manager import additive_bias

DIGITS = r"[0-9]{24}"  # SmolLM2 tokenizes digits one by one: 24 tokens, then eos
WORD = r"[a-z]{2,6}( [a-z]{2,6}){0,3}"


@pytest.fixture(scope="module")
def engine(tiny_chat_model_path):
    with Engine(tiny_chat_model_path, device="cpu", max_total_tokens=8192) as eng:
        yield eng


def greedy(n: int = 32, **kw) -> dict:
    return {"max_new_tokens": n, "temperature": 0, **kw}


def test_bitmask_application_matches_xgrammar_and_spares_other_rows():
    torch.manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partial
    logits = torch.randn(5, vocab)
    bits = torch.randint(-2**31, 2**31 - 1, (2, 32), dtype=torch.int32)
    rows = torch.tensor([1, 3])
    want = logits.clone()
    full = torch.full((5, 32), -1, dtype=torch.int32)
    full[rows] = bits
    xgr.apply_token_bitmask_inplace(want, full, vocab_size=vocab)
    for mask in (bits, additive_bias(bits, vocab)):  # the GPU form and the CPU form
        got = logits.clone()
        apply_token_bitmask(got, rows, mask)
        assert torch.equal(got, want)
        assert torch.equal(got[[0, 2, 4]], logits[[0, 2, 4]])  # unconstrained rows untouched
    assert torch.isneginf(want[1]).sum() > 100


@pytest.mark.parametrize("params, fragment", [
    ({"regex": "a(b"}, "sampling_params.regex: invalid grammar"),
    ({"json_schema": "{not json"}, "sampling_params.json_schema: not valid JSON"),
    ({"json_schema": {"type": "frob"}}, "sampling_params.json_schema: invalid grammar"),
    ({"ebnf": 'root ::= "a'}, "sampling_params.ebnf: invalid grammar"),
    ({"ebnf": 'start ::= "a"'}, "root rule"),
    ({"choices": []}, "sampling_params.choices"),
    ({"regex": "a", "choices": ["b"]}, "at most one of json_schema, regex, ebnf, choices"),
])
def test_bad_grammar_is_refused_at_submit_and_others_keep_running(engine, params, fragment):
    results = {}
    other = threading.Thread(target=lambda: results.update(out=engine.generate(
        prompt="Count:", sampling_params=greedy(24, ignore_eos=True))))
    other.start()
    with pytest.raises(ValueError, match=re.escape(fragment)):
        engine.generate(prompt="x", sampling_params=params)
    other.join()
    assert results["out"]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(results["out"]["output_ids"]) == 24


def test_regex_choices_and_ebnf_outputs_match_and_stop(engine):
    ebnf = 'root ::= "(" num (op num)* ")"\nnum ::= [1-9]\nop ::= "+" | "*"'
    outs = engine.generate(prompt=["Digits:", "Pick one:", "Words:", "Sum:"], sampling_params=[
        greedy(40, regex=DIGITS), greedy(choices=["red", "green", "dark blue"]),
        {"regex": WORD, "max_new_tokens": 40, "temperature": 1.0, "seed": 3},
        {"ebnf": ebnf, "max_new_tokens": 12, "temperature": 1.0, "seed": 4}])
    assert re.fullmatch(DIGITS, outs[0]["text"])
    assert outs[1]["text"] in ("red", "green", "dark blue")
    assert re.fullmatch(WORD, outs[2]["text"])
    assert re.fullmatch(r"\([1-9]([+*][1-9])*\)", outs[3]["text"]) or \
        outs[3]["meta_info"]["finish_reason"]["type"] == "length"
    for out in outs[:3]:
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_grammar_terminates_with_stop_even_when_eos_is_ignored(engine):
    out = engine.generate(prompt="Pick:", sampling_params=greedy(
        choices=["alpha", "beta"], ignore_eos=True))
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert out["text"] in ("alpha", "beta")


def test_n_samples_each_follow_the_grammar(engine):
    outs = engine.generate(prompt="Words:", sampling_params={
        "regex": WORD, "n": 4, "temperature": 1.0, "seed": 11, "max_new_tokens": 40})
    assert len(outs) == 4
    for out in outs:
        assert re.fullmatch(WORD, out["text"]), out["text"]
    assert len({o["text"] for o in outs}) > 1  # each sample has its own matcher and draw


def test_mixed_batch_leaves_unconstrained_rows_unchanged(engine):
    prompts = ["The sea is", "Numbers:", "Once upon a time", "Colors:"]
    alone = [engine.generate(prompt=p, sampling_params=greedy(20, ignore_eos=True))
             for p in prompts[::2]]
    mixed = engine.generate(prompt=prompts, sampling_params=[
        greedy(20, ignore_eos=True), greedy(40, regex=DIGITS),
        greedy(20, ignore_eos=True), greedy(choices=["red", "blue"])])
    assert [m["output_ids"] for m in mixed[::2]] == [a["output_ids"] for a in alone]
    assert re.fullmatch(DIGITS, mixed[1]["text"]) and mixed[3]["text"] in ("red", "blue")


def test_logprobs_are_of_the_masked_distribution_and_raw_on_request(engine):
    params = {"regex": "[ab]", "temperature": 1.0, "seed": 5, "max_new_tokens": 4}
    out = engine.generate(prompt="Letter:", sampling_params=params, return_logprob=True,
                          top_logprobs_num=3)
    top = out["meta_info"]["output_top_logprobs"][0]
    allowed = [lp for lp, _ in top if math.isfinite(lp)]
    assert len(allowed) == 2 and math.isclose(sum(math.exp(lp) for lp in allowed), 1.0,
                                              rel_tol=1e-4)
    raw = engine.generate(prompt="Letter:", sampling_params={**params, "logprob_mode": "raw"},
                          return_logprob=True)
    assert raw["output_ids"] == out["output_ids"]
    chosen, raw_chosen = (o["meta_info"]["output_token_logprobs"][0][0] for o in (out, raw))
    assert raw_chosen < chosen  # the unmasked distribution spreads mass over 49k tokens


def test_request_waits_for_its_grammar_while_others_step(engine):
    """A slow compile parks its request in the grammar queue; the batch keeps stepping."""
    grammars = engine.scheduler.grammars
    release = threading.Event()
    compile_ = grammars.backend.compile
    grammars.backend.compile = lambda parsed: (release.wait(30), compile_(parsed))[1]
    results = {}
    try:
        slow = threading.Thread(target=lambda: results.update(slow=engine.generate(
            prompt="Code:", sampling_params=greedy(40, regex=r"[0-9]{5}-slow"))))
        slow.start()
        fast = engine.generate(prompt="Hello", sampling_params=greedy(8, ignore_eos=True))
        assert len(fast["output_ids"]) == 8 and slow.is_alive()
    finally:
        release.set()
        grammars.backend.compile = compile_
    slow.join(30)
    assert re.fullmatch(r"[0-9]{5}-slow", results["slow"]["text"])


def test_compile_cache_is_shared_across_requests(engine):
    grammars = engine.scheduler.grammars
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    before = dict(grammars.stats)
    engine.generate(prompt=["a", "b"], sampling_params=greedy(1, json_schema=schema))
    engine.generate(prompt="c", sampling_params=greedy(1, json_schema=dict(schema)))
    assert grammars.stats["compiles"] - before["compiles"] == 1
    assert grammars.stats["cache_hits"] - before["cache_hits"] == 2


def test_backend_none_refuses_grammars(tiny_chat_model_path):
    with pytest.raises(ValueError, match="grammar_backend must be one of"):
        Engine(tiny_chat_model_path, device="cpu", max_total_tokens=1024,
               grammar_backend="outlines")
    with Engine(tiny_chat_model_path, device="cpu", max_total_tokens=1024,
                grammar_backend="none") as eng:
        with pytest.raises(ValueError, match="sampling_params.regex: .*grammar_backend='none'"):
            eng.generate(prompt="x", sampling_params={"regex": "a"})
        assert len(eng.generate(prompt="x", sampling_params=greedy(3, ignore_eos=True))[
            "output_ids"]) == 3


def test_retraction_under_kv_pressure_keeps_outputs_valid(tiny_chat_model_path):
    # Every request uses its whole budget (40 digits + eos), so admission's reservation of
    # 0.7 x max_new_tokens overcommits the 256-token pool and decoding must retract.
    prompts = [f"Request {i}: digits" for i in range(12)]
    regex = r"[0-9]{40}"
    with Engine(tiny_chat_model_path, device="cpu", max_total_tokens=256) as eng:
        outs = eng.generate(prompt=prompts, sampling_params={
            "regex": regex, "temperature": 1.0, "seed": 2, "max_new_tokens": 41})
        eng.check_integrity()
    assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0
    for out in outs:
        assert re.fullmatch(regex, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_weight_update_mid_generation_keeps_outputs_valid(tiny_chat_model_path):
    tensors = {k: v * 1.05 for k, v in load_file(
        f"{tiny_chat_model_path}/model.safetensors").items()}
    regex = r"[0-9]{40}"
    with Engine(tiny_chat_model_path, device="cpu", max_total_tokens=8192) as eng:
        stream = eng.generate(prompt=["Digits:", "More digits:"], stream=True, sampling_params={
            "regex": regex, "temperature": 1.0, "seed": 9, "max_new_tokens": 60})
        texts: dict[str, str] = {}
        finals: dict[str, dict] = {}
        updated = False
        for event in stream:
            rid = event["meta_info"]["id"]
            texts[rid] = texts.get(rid, "") + event["text"]
            if event["meta_info"]["finish_reason"] is not None:
                finals[rid] = event["meta_info"]
            if not updated and len(event["output_ids"]) and len(texts[rid]) >= 5:
                updated = True
                assert eng.update_weights_from_tensor(
                    tensors, weight_version="v1", pause_mode="retract")["success"]
    assert updated
    for rid, meta in finals.items():
        assert re.fullmatch(regex, texts[rid]), texts[rid]
        assert meta["finish_reason"]["type"] == "stop"
        assert [s["version"] for s in meta["weight_versions"]][-1] == "v1"
    assert any(m["num_retractions"] for m in finals.values())


def test_sampler_bitmask_rows_with_penalties_ban_and_raw_logprobs():
    """Grammar rows in SamplingBatchInfo: masked before temperature, the min_new_tokens ban
    yields where the grammar allows only eos, raw logprobs ignore the mask, other rows are
    drawn exactly as in a batch without grammar rows."""
    from hotswap.engine.core.sampling_params import SamplingParams
    from hotswap.engine.executor.sampling import Sampler
    from hotswap.engine.executor.sampling_batch_info import SamplingBatchInfo

    torch.manual_seed(3)
    vocab, eos = 64, 0
    logits = torch.randn(4, vocab)
    params = [SamplingParams(temperature=0.7, seed=1, min_new_tokens=3),
              SamplingParams(temperature=0.0, min_new_tokens=3),
              SamplingParams(temperature=0.9, seed=2, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=4, logprob_mode="raw")]

    def info() -> SamplingBatchInfo:
        return SamplingBatchInfo.build(params, [[5]] * 4, [[7, 8]] * 4, [1] * 4, [eos], vocab)

    plain = Sampler().sample(logits, info(), return_logprob=True)
    bits = torch.zeros(3, 2, dtype=torch.int32)
    bits[0, 0] = (1 << 4) | (1 << 9)  # row 0: tokens 4 and 9
    bits[1, 0] = 1 << eos  # row 1: only eos, although min_new_tokens bans it
    bits[2, 1] = 1 << 3  # row 3: token 35 only
    constrained = info()
    constrained.grammar_rows = torch.tensor([0, 1, 3])
    constrained.grammar_bitmask = additive_bias(bits, vocab)
    out = Sampler().sample(logits, constrained, return_logprob=True)
    assert int(out.next_token_ids[0]) in (4, 9) and int(out.next_token_ids[1]) == eos
    assert int(out.next_token_ids[2]) == int(plain.next_token_ids[2])
    assert float(out.logprobs[2]) == float(plain.logprobs[2])
    assert int(out.next_token_ids[3]) == 35
    raw = torch.log_softmax(logits[3], dim=-1)[35]
    assert math.isclose(float(out.logprobs[3]), float(raw), rel_tol=1e-5)
