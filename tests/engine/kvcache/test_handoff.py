"""The KV handoff between a prefill engine and a decode engine (engine/kvcache/handoff.py):
what goes through a pair equals one engine (tokens, logprobs, versions, n > 1, grammar, LoRA,
routed experts, streams), and KV of another namespace, or bytes that changed or stopped short
in transit, is refused and recomputed without losing a page."""

from __future__ import annotations

import os
import random
import re
import tempfile

import pytest
import torch
from fixtures import save_random_lora, token_logprobs, write_moe, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine
from hotswap.engine.kvcache.handoff import KVHandoff

KW = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("chat")), num_hidden_layers=3,
                                 max_position_embeddings=512)


@pytest.fixture(scope="module", params=[1, 4], ids=["page1", "page4"])
def trio(request, model_path):
    """One engine (the reference), a prefill engine and a decode engine."""
    kw = {**KW, "page_size": request.param}
    engines = (Engine(model_path, **kw), Engine(model_path, role="prefill", **kw),
               Engine(model_path, role="decode", **kw))
    yield engines
    for engine in engines:
        engine.shutdown()


def prompts(seed: int, count: int, lo: int = 5, hi: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 460) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def through_pair(pre: Engine, dec: Engine, ids: list[int], params: dict,
                 transport: str = "inline", **kwargs):
    first = pre.prefill(input_ids=ids, sampling_params={**params, "n": 1},
                        transport=transport, **kwargs)
    return dec.generate_from_handoff(first, params, **kwargs)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_greedy_through_the_pair_equals_one_engine(trio, transport):
    one, pre, dec = trio
    for ids in prompts(0, 6):
        ref = one.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        out = through_pair(pre, dec, ids, GREEDY, transport, return_logprob=True)
        handoff = out["meta_info"]["kv_handoff"]
        assert handoff["accepted"] and handoff["reason"] is None
        page = dec.config.page_size
        assert handoff["tokens"] == len(ids) - len(ids) % page
        assert out["output_ids"] == ref["output_ids"]
        torch.testing.assert_close(token_logprobs(out), token_logprobs(ref), atol=1e-5, rtol=0)
        assert out["meta_info"]["weight_versions"] == ref["meta_info"]["weight_versions"]
        assert out["meta_info"]["prompt_tokens"] == len(ids)
    for engine in trio:
        engine.check_integrity()
    if transport == "shm":  # every file written was read and removed
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        assert not [f for f in os.listdir(folder) if f.startswith(f"hotswap-kv-{os.getpid()}-")]


def test_seeded_samples_n_top_logprobs_and_streams(trio):
    one, pre, dec = trio
    params = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 11, "n": 3}
    for i, ids in enumerate(prompts(1, 3)):
        ref = one.generate(input_ids=ids, sampling_params=params, return_logprob=True,
                           top_logprobs_num=3, rid=f"r{i}")
        out = through_pair(pre, dec, ids, params, return_logprob=True, top_logprobs_num=3,
                           rid=f"r{i}")
        assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
        assert [o["meta_info"]["id"] for o in out] == [r["meta_info"]["id"] for r in ref]
        for o, r in zip(out, ref):
            torch.testing.assert_close(token_logprobs(o), token_logprobs(r), atol=1e-5, rtol=0)
            assert [[t for _, t in step] for step in o["meta_info"]["output_top_logprobs"]] == \
                [[t for _, t in step] for step in r["meta_info"]["output_top_logprobs"]]
        first = pre.prefill(input_ids=ids, sampling_params={**params, "n": 1}, rid=f"r{i}-0")
        events = list(dec.generate_from_handoff(first, params, stream=True, rid=f"r{i}"))
        streamed = {f"r{i}-0": list(first["output_ids"])}  # the first token: the prefill's
        for event in events:
            streamed.setdefault(event["meta_info"]["id"], []).extend(event["output_ids"])
        assert streamed == {r["meta_info"]["id"]: r["output_ids"] for r in ref}


def test_a_first_token_that_ends_the_request_is_final(trio):
    one, pre, dec = trio
    ids = prompts(2, 1)[0]
    params = {**GREEDY, "max_new_tokens": 1}
    first = pre.prefill(input_ids=ids, sampling_params=params, return_logprob=True)
    assert first["meta_info"]["finish_reason"]["type"] == "length"
    out = dec.generate_from_handoff(first, params, return_logprob=True)
    ref = one.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    assert out["output_ids"] == ref["output_ids"]
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_grammar_through_the_pair(trio):
    one, pre, dec = trio
    params = {"max_new_tokens": 16, "temperature": 0, "regex": "(yes|no)-[0-9]{3}"}
    for ids in prompts(3, 3, 10, 60):
        ref = one.generate(input_ids=ids, sampling_params=params)
        out = through_pair(pre, dec, ids, params)
        assert out["output_ids"] == ref["output_ids"]
        assert re.fullmatch("(yes|no)-[0-9]{3}", out["text"]), out["text"]


def test_kv_of_another_weight_version_is_refused_and_recomputed(model_path, monkeypatch):
    """A handoff that straddles an update: computed under v0, arriving at a decode engine that
    serves v1. It is refused; the prompt is computed again under v1, so every decoded token is
    what a fresh engine with v1's weights gives (the first token, sampled under v0, says so in
    its version span). With the namespace check switched off the same call decodes on v0's KV
    and the comparison catches it."""
    pre = Engine(model_path, role="prefill", **KW)
    dec = Engine(model_path, role="decode", **KW)
    torch.manual_seed(0)
    new = {n: t + 0.05 * torch.randn_like(t)
           for n, t in load_file(f"{model_path}/model.safetensors").items()}
    fresh = Engine(model_path, **KW)
    assert fresh.update_weights_from_tensor(list(new.items()), weight_version="v1")["success"]
    try:
        ids = prompts(4, 1, 120, 121)[0]
        first = pre.prefill(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        assert first["meta_info"]["kv_handoff"]["weight_version"] == "0"
        assert dec.update_weights_from_tensor(list(new.items()), weight_version="v1")["success"]
        out = dec.generate_from_handoff(first, GREEDY, return_logprob=True)
        handoff = out["meta_info"]["kv_handoff"]
        assert not handoff["accepted"] and "weight_version '0' (here 'v1')" in handoff["reason"]
        assert out["meta_info"]["weight_versions"] == [
            {"version": "0", "start": 0, "end": 1}, {"version": "v1", "start": 1, "end": 12}]
        ref = fresh.generate(input_ids=ids + first["output_ids"],
                             sampling_params={**GREEDY, "max_new_tokens": 11},
                             return_logprob=True)
        assert out["output_ids"][1:] == ref["output_ids"]
        torch.testing.assert_close(token_logprobs(out)[1:], token_logprobs(ref), atol=1e-5,
                                   rtol=0)
        dec.check_integrity()

        monkeypatch.setattr(KVHandoff, "refusal", lambda self, ns: None)
        assert dec.flush_cache()["success"]  # else v1's KV of this prompt is found in the tree
        first = pre.prefill(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        stale = dec.generate_from_handoff(first, GREEDY, return_logprob=True)
        assert stale["meta_info"]["kv_handoff"]["accepted"]  # v0's KV read under v1
        diff = max(abs(a - b) for a, b in zip(token_logprobs(stale)[1:], token_logprobs(ref)))
        assert diff > 1e-3, "decoding on v0's KV must show against v1's reference"
    finally:
        for engine in (pre, dec, fresh):
            engine.shutdown()


def free_slots(engine: Engine) -> int:
    engine.flush_cache()
    return engine.runner.allocator.available_size()


def test_corrupt_and_truncated_transfers_are_refused_and_hold_no_pages(trio):
    one, pre, dec = trio
    ids = prompts(5, 1, 80, 81)[0]
    ref = one.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    before = free_slots(dec)

    first = pre.prefill(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    payload = first["meta_info"]["kv_handoff"]["payload"]
    payload[payload.numel() // 2] ^= 0x40  # one bit flipped in transit
    out = dec.generate_from_handoff(first, GREEDY, return_logprob=True)
    assert not out["meta_info"]["kv_handoff"]["accepted"]
    assert "checksum" in out["meta_info"]["kv_handoff"]["reason"]
    assert out["output_ids"] == ref["output_ids"]
    assert out["meta_info"]["cached_tokens"] == 0  # computed here, nothing taken in

    first = pre.prefill(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                        transport="shm")
    path = first["meta_info"]["kv_handoff"]["location"]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)  # the writer stopped a third of the way
    out = dec.generate_from_handoff(first, GREEDY, return_logprob=True)
    assert "truncated transfer" in out["meta_info"]["kv_handoff"]["reason"]
    assert out["output_ids"] == ref["output_ids"]
    assert not os.path.exists(path)

    first = pre.prefill(input_ids=ids, sampling_params=GREEDY, transport="shm")
    os.unlink(first["meta_info"]["kv_handoff"]["location"])  # never arrived
    out = dec.generate_from_handoff(first, GREEDY)
    assert "gone" in out["meta_info"]["kv_handoff"]["reason"]
    assert out["output_ids"] == ref["output_ids"]
    assert free_slots(dec) == before
    dec.check_integrity()
    assert dec.scheduler.stats["handoffs_refused"] >= 3


def test_salt_and_adapter_versions_must_match(model_path, tmp_path):
    lora_path = str(tmp_path / "lora")
    save_random_lora(model_path, lora_path, ["q_proj", "v_proj"], seed=1)
    one, pre, dec = (Engine(model_path, **KW), Engine(model_path, role="prefill", **KW),
                     Engine(model_path, role="decode", **KW))
    try:
        for engine in (one, pre, dec):
            assert engine.load_lora_adapter("a", lora_path)["success"]
        ids = prompts(6, 1, 40, 41)[0]
        ref = one.generate(input_ids=ids, sampling_params=GREEDY, lora_name="a",
                           return_logprob=True)
        out = through_pair(pre, dec, ids, GREEDY, lora_name="a", return_logprob=True)
        assert out["meta_info"]["kv_handoff"]["accepted"]
        assert out["output_ids"] == ref["output_ids"]
        torch.testing.assert_close(token_logprobs(out), token_logprobs(ref), atol=1e-5, rtol=0)
        assert out["meta_info"]["adapter_version"] == ref["meta_info"]["adapter_version"]

        first = pre.prefill(input_ids=ids, sampling_params=GREEDY, cache_salt="alice")
        out = dec.generate_from_handoff(first, GREEDY, cache_salt="bob")
        assert "cache_salt 'alice' (here 'bob')" in out["meta_info"]["kv_handoff"]["reason"]

        assert dec.load_lora_adapter("a", lora_path)["success"]  # version 2 here, 1 there
        first = pre.prefill(input_ids=ids, sampling_params=GREEDY, lora_name="a")
        out = dec.generate_from_handoff(first, GREEDY, lora_name="a")
        assert "adapter_version 1 (here 2)" in out["meta_info"]["kv_handoff"]["reason"]
        assert out["output_ids"] == ref["output_ids"]  # same adapter weights, recomputed
    finally:
        for engine in (one, pre, dec):
            engine.shutdown()


def test_routed_experts_through_the_pair(tmp_path):
    path = write_moe(str(tmp_path / "moe"), "qwen3_moe", seed=2)
    kw = {**KW, "enable_return_routed_experts": True}
    one, pre, dec = (Engine(path, **kw), Engine(path, role="prefill", **kw),
                     Engine(path, role="decode", **kw))
    try:
        for ids in prompts(7, 3, 10, 90):
            ref = one.generate(input_ids=ids, sampling_params=GREEDY,
                               return_routed_experts=True)
            out = through_pair(pre, dec, ids, GREEDY, return_routed_experts=True)
            assert out["meta_info"]["kv_handoff"]["accepted"]
            assert out["output_ids"] == ref["output_ids"]
            routes, want = out["meta_info"]["routed_experts"], ref["meta_info"]["routed_experts"]
            assert routes.shape == want.shape == (len(ids) + GREEDY["max_new_tokens"] - 1,
                                                  *want.shape[1:])
            assert (routes == want).all()
    finally:
        for engine in (one, pre, dec):
            engine.shutdown()


def test_group_transport_in_process(model_path):
    from hotswap.weight_sync.group import free_port

    one, pre, dec = (Engine(model_path, **KW), Engine(model_path, role="prefill", **KW),
                     Engine(model_path, role="decode", **KW))
    try:
        from concurrent.futures import ThreadPoolExecutor

        port = free_port()
        with ThreadPoolExecutor(2) as pool:
            joined = [pool.submit(e.init_kv_transfer_group, "127.0.0.1", port, rank, 2)
                      for rank, e in enumerate((pre, dec))]
            assert all(j.result()["success"] for j in joined)
            for ids in prompts(8, 3):
                ref = one.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
                first = pre.prefill(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                                    transport="group")
                handoff = first["meta_info"]["kv_handoff"]
                assert handoff["transport"] == "group" and "payload" not in handoff
                sent = pool.submit(pre.send_kv_handoff, handoff["id"], 1)
                out = dec.generate_from_handoff(first, GREEDY, return_logprob=True)
                assert sent.result()["success"]
                assert out["meta_info"]["kv_handoff"]["accepted"]
                assert out["output_ids"] == ref["output_ids"]
                torch.testing.assert_close(token_logprobs(out), token_logprobs(ref), atol=1e-5,
                                           rtol=0)
        first = pre.prefill(input_ids=ids, sampling_params=GREEDY, transport="group")
        assert pre.drop_kv_handoff(first["meta_info"]["kv_handoff"]["id"])
        with pytest.raises(ValueError, match="not held here"):
            pre.send_kv_handoff(first["meta_info"]["kv_handoff"]["id"], 1)
    finally:
        for engine in (one, pre, dec):
            engine.shutdown()


def test_roles_and_bad_input(trio, model_path):
    one, pre, dec = trio
    ids = prompts(9, 1)[0]
    with pytest.raises(ValueError, match="role='prefill'"):
        pre.generate(input_ids=ids, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="role='decode'"):
        dec.prefill(input_ids=ids, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="n=1"):
        pre.prefill(input_ids=ids, sampling_params={**GREEDY, "n": 2})
    with pytest.raises(ValueError, match="transport"):
        pre.prefill(input_ids=ids, sampling_params=GREEDY, transport="carrier-pigeon")
    with pytest.raises(ValueError, match="init_kv_transfer_group"):
        pre.prefill(input_ids=ids, sampling_params=GREEDY, transport="group")
    with pytest.raises(ValueError, match="kv_handoff"):
        dec.generate_from_handoff({"output_ids": [5], "meta_info": {}}, GREEDY)
    first = pre.prefill(input_ids=ids, sampling_params=GREEDY)
    broken = {**first, "meta_info": {**first["meta_info"], "kv_handoff": {
        k: v for k, v in first["meta_info"]["kv_handoff"].items() if k != "checksum"}}}
    with pytest.raises(ValueError, match="missing fields \\['checksum'\\]"):
        dec.generate_from_handoff(broken, GREEDY)
    with pytest.raises(ValueError, match="shm handoff file"):
        bad = dict(first["meta_info"]["kv_handoff"], transport="shm", location="/etc/passwd")
        del bad["payload"]
        dec.generate_from_handoff({**first, "meta_info": {**first["meta_info"],
                                                          "kv_handoff": bad}}, GREEDY)
    with pytest.raises(ValueError, match="role must be one of"):
        Engine(model_path, role="both-ways", **KW)
    with pytest.raises(ValueError, match="enable_prefix_cache"):
        Engine(model_path, role="decode", enable_prefix_cache=False, **KW)
    out = dec.generate(input_ids=ids, sampling_params=GREEDY)  # a decode engine prefills too
    assert out["output_ids"] == one.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    for engine in trio:
        engine.check_integrity()
