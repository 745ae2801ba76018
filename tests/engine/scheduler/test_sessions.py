"""Sessions: a conversation's KV pinned across turns while other traffic evicts the cache, and
retired by a weight update like any KV."""

from __future__ import annotations

import time

import pytest

from hotswap.engine import Engine

TURN = 24  # new tokens a turn adds (the "tool result" and the next question)
POOL = 768  # tokens: small, so the other traffic between turns evicts every unpinned prefix


@pytest.fixture(scope="module")
def engine(tiny_chat_model_path):
    with Engine(tiny_chat_model_path, device="cpu", dtype="float32", max_total_tokens=POOL,
                session_budget_fraction=0.5) as eng:
        yield eng


def _conversation(engine: Engine, session: str | None, turns: int = 5,
                  between=None) -> list[tuple[int, int]]:
    """(prompt tokens, prefilled tokens) per turn; `between(k)` runs before turn k > 0."""
    ids = [7 + (i * 13) % 200 for i in range(40)]
    out = []
    for k in range(turns):
        if k and between is not None:
            between(k)
        got = engine.generate(input_ids=ids, session_id=session, sampling_params={
            "max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        meta = got["meta_info"]
        out.append((meta["prompt_tokens"], meta["prompt_tokens"] - meta["cached_tokens"]))
        ids = ids + got["output_ids"] + [300 + (k * 7 + i) % 100 for i in range(TURN)]
    return out


def _flood(engine: Engine, k: int) -> None:
    """Other traffic: distinct prompts that together need the whole pool."""
    for wave in range(2):
        prompts = [[400 + ((k * 31 + (wave * 5 + j) * 17 + i * 3) % 800) for i in range(120)]
                   for j in range(5)]
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4,
                                                            "ignore_eos": True})


def test_a_session_prefills_only_each_turn_s_new_tokens_under_cache_pressure(engine) -> None:
    engine.flush_cache()
    without = _conversation(engine, None, between=lambda k: _flood(engine, k))
    session = engine.open_session(ttl_s=60)
    with_pin = _conversation(engine, session, between=lambda k: _flood(engine, k))
    assert engine.close_session(session)
    print("\nturn  prompt  prefilled without / with a session")
    for k, ((p, a), (_, b)) in enumerate(zip(without, with_pin)):
        print(f"{k:4d} {p:7d} {a:10d} {b:6d}")
    assert all(a == p for p, a in without[1:])  # evicted: every turn prefilled whole
    # With the pin, only the turn's new tokens (and the last sampled token, whose KV no forward
    # computed) are prefilled.
    assert [b for _, b in with_pin[1:]] == [TURN + 1] * 4
    engine.check_integrity()


def test_a_weight_update_between_turns_retires_the_pinned_kv(engine, tiny_chat_model_path) -> None:
    from safetensors.torch import load_file

    weights = load_file(f"{tiny_chat_model_path}/model.safetensors")
    engine.flush_cache()
    session = engine.open_session(ttl_s=60)

    def update(k: int) -> None:
        if k == 2:
            engine.update_weights_from_tensor(list(weights.items()))

    turns = _conversation(engine, session, turns=4, between=update)
    assert [b for _, b in turns[1:]] == [TURN + 1, turns[2][0], TURN + 1]  # turn 2: new weights
    engine.check_integrity()
    assert engine.close_session(session) and not engine.close_session(session)
    assert engine.get_load()["sessions"] == 0


def test_unknown_sessions_expiry_and_bad_arguments(engine) -> None:
    with pytest.raises(ValueError, match="no such session"):
        engine.generate(input_ids=[1, 2, 3], session_id="nope",
                        sampling_params={"max_new_tokens": 1})
    session = engine.open_session(ttl_s=60)
    with pytest.raises(ValueError, match="n must be 1"):
        engine.generate(input_ids=[1, 2, 3], session_id=session,
                        sampling_params={"max_new_tokens": 1, "n": 2})
    with pytest.raises(ValueError, match="already open"):
        engine.open_session(session_id=session)
    with pytest.raises(ValueError, match="ttl_s"):
        engine.open_session(ttl_s=0)
    assert engine.close_session(session)
    short = engine.open_session(ttl_s=0.2)
    engine.generate(input_ids=list(range(5, 60)), session_id=short,
                    sampling_params={"max_new_tokens": 2})
    time.sleep(0.5)  # the idle scheduler wakes for the expiry and frees the pin
    assert engine.get_load()["sessions"] == 0
    assert not engine.close_session(short)
    engine.check_integrity()


def test_the_pin_budget_drops_the_least_recently_used_session_s_pin(engine) -> None:
    """The budget is half of the 768-token pool: two 300-token conversations do not both fit,
    so the older one's pin goes and the other traffic evicts its prefix."""
    engine.flush_cache()
    first, second = engine.open_session(ttl_s=60), engine.open_session(ttl_s=60)
    prompts = {first: [11 + i % 97 for i in range(300)], second: [13 + i % 89 for i in range(300)]}
    outs = {}
    for session in (first, second):
        outs[session] = engine.generate(input_ids=prompts[session], session_id=session,
                                        sampling_params={"max_new_tokens": 2,
                                                         "ignore_eos": True})
    _flood(engine, 9)
    prefilled = {}
    for session in (first, second):
        ids = prompts[session] + outs[session]["output_ids"] + [5, 6, 7]
        meta = engine.generate(input_ids=ids, session_id=session,
                               sampling_params={"max_new_tokens": 1})["meta_info"]
        prefilled[session] = meta["prompt_tokens"] - meta["cached_tokens"]
    assert prefilled[second] == 4 and prefilled[first] > 100, prefilled
    assert engine.close_session(first) and engine.close_session(second)
    engine.check_integrity()
