"""Reward models (engine/models/reward.py, docs/api.md#scoring): tiny random Llama, Qwen2 and
Qwen3 `*ForSequenceClassification` / `*ForTokenClassification` checkpoints written here, scored
by Engine.classify and by HF's own models in float32."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fixtures import serve, write_reward_model, write_tiny_chat_model

from hotswap.engine import Engine, RemoteEngine
from hotswap.fleet import Router

KW = {"device": "cpu", "dtype": "float32", "max_total_tokens": 2048}
EOS = 2  # the fixture tokenizer's <|im_end|>
ATOL = 1e-4


def prompts(pad: int) -> list[list[int]]:
    """Prompts of several lengths, one ending with eos and one with the pad id: padding-free
    scoring takes their true last token."""
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 9, 17, 12)]
    ids[1][-1] = EOS
    ids[2][-1] = pad
    ids[3][4] = EOS  # an eos inside a prompt is a token like any other
    return ids


@torch.no_grad()
def hf_alone(model, ids: list[int]) -> torch.Tensor:
    """HF's score of one unpadded sequence: with no pad id, its last token."""
    pad, model.config.pad_token_id = model.config.pad_token_id, None
    try:
        return model(torch.tensor([ids])).logits[0]
    finally:
        model.config.pad_token_id = pad


@torch.no_grad()
def hf_padded(model, batch: list[list[int]], left: bool) -> torch.Tensor:
    """HF's scores of a padded batch, padded with an id no prompt holds (HF finds the last
    token as the rightmost non-pad one), positions counted over the real tokens."""
    fill = model.config.vocab_size - 1
    width = max(map(len, batch))
    rows, masks = [], []
    for ids in batch:
        pad = [fill] * (width - len(ids))
        rows.append(pad + ids if left else ids + pad)
        mask = [0] * len(pad) + [1] * len(ids) if left else [1] * len(ids) + [0] * len(pad)
        masks.append(mask)
    mask = torch.tensor(masks)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    pad, model.config.pad_token_id = model.config.pad_token_id, fill
    try:
        return model(torch.tensor(rows), attention_mask=mask, position_ids=positions).logits
    finally:
        model.config.pad_token_id = pad


def activated(raw: torch.Tensor) -> torch.Tensor:
    return raw.sigmoid() if raw.shape[-1] == 1 else raw.softmax(-1)


@pytest.mark.parametrize("pad_is_eos", [False, True], ids=["pad!=eos", "pad==eos"])
@pytest.mark.parametrize("num_labels", [1, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_scores_match_hf_alone_batched_padded_and_cached(tmp_path, arch, num_labels, pad_is_eos):
    pad = EOS if pad_is_eos else 0
    model = write_reward_model(str(tmp_path), arch, num_labels, pad)
    batch = prompts(pad)
    alone = torch.stack([hf_alone(model, ids) for ids in batch])
    for left in (False, True):
        torch.testing.assert_close(hf_padded(model, batch, left), alone, atol=ATOL, rtol=0)
    with Engine(str(tmp_path), chunked_prefill_size=8, **KW) as engine:  # long prompts chunk
        outs = engine.classify(input_ids=batch)
        scores = torch.tensor([o["scores"] for o in outs])
        assert scores.shape == (len(batch), num_labels)
        torch.testing.assert_close(scores, alone, atol=ATOL, rtol=0)
        single = engine.classify(input_ids=batch[0], rid="one")
        assert single["meta_info"]["id"] == "one"
        torch.testing.assert_close(torch.tensor(single["scores"]), alone[0], atol=ATOL, rtol=0)
        # The same prompts again: fully cached, the last token recomputed, the same scores.
        again = engine.classify(input_ids=batch, activation=True)
        for ids, out in zip(batch, again, strict=True):
            assert out["meta_info"]["cached_tokens"] == len(ids) - 1
            assert out["meta_info"]["prompt_tokens"] == len(ids)
        torch.testing.assert_close(torch.tensor([o["scores"] for o in again]), activated(alone),
                                   atol=ATOL, rtol=0)
        assert again[0]["meta_info"]["weight_version"] == engine.get_weight_version()
        # A group's responses to one prompt, scored in one call, share the prompt's KV.
        group = [batch[2][:10] + ids[:3] for ids in batch]
        shared = engine.classify(input_ids=group)
        assert all(o["meta_info"]["cached_tokens"] >= 8 for o in shared)
        torch.testing.assert_close(torch.tensor([o["scores"] for o in shared]),
                                   torch.stack([hf_alone(model, ids) for ids in group]),
                                   atol=ATOL, rtol=0)
        engine.check_integrity()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_step_and_token_scores_match_hf_token_classification(tmp_path, arch):
    tag = 7
    model = write_reward_model(str(tmp_path), arch, 2, 0, token=True)
    assert model.score.bias is not None  # HF's token classifier has a bias: it is loaded too
    ids = torch.randint(10, 250, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    steps = [4, 11, 22]
    for i in steps:
        ids[i] = tag
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    # chunked prefill: the per-token rows of every chunk are kept
    with Engine(str(tmp_path), chunked_prefill_size=8, **KW) as engine:
        engine.classify(input_ids=ids)  # the prompt is in the cache now
        out = engine.classify(input_ids=ids, step_tag_id=tag, activation=True)
        assert out["meta_info"]["cached_tokens"] == 0  # per-token scores read no cache
        torch.testing.assert_close(torch.tensor(out["step_scores"]), ref[steps].softmax(-1),
                                   atol=ATOL, rtol=0)
        raw = engine.classify(input_ids=[ids, ids[:9]], return_token_scores=True)
        torch.testing.assert_close(torch.tensor(raw[0]["token_scores"]), ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(raw[1]["token_scores"]), ref[:9], atol=ATOL,
                                   rtol=0)
        torch.testing.assert_close(torch.tensor(raw[0]["scores"]), ref[-1], atol=ATOL, rtol=0)
        picked = engine.classify(input_ids=ids, step_tag_id=tag, returned_token_ids=[1],
                                 activation=True)
        torch.testing.assert_close(torch.tensor(picked["step_scores"]),
                                   ref[steps][:, [1]].sigmoid(), atol=ATOL, rtol=0)
        engine.check_integrity()


@pytest.fixture(scope="module")
def reward_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("rm"))
    write_reward_model(path, "qwen2", 1, 0)
    return path


@pytest.fixture(scope="module")
def engine(reward_path):
    with Engine(reward_path, **KW) as engine:
        yield engine


def test_messages_use_the_reward_models_chat_template(engine):
    chat = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."}]
    ids = engine.tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=False)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    by_chat = engine.classify(messages=[chat, chat[:1]])
    assert by_chat[0]["scores"] == pytest.approx(engine.classify(input_ids=ids)["scores"],
                                                 abs=ATOL)
    assert by_chat[0]["meta_info"]["prompt_tokens"] == len(ids)
    assert by_chat[1]["meta_info"]["prompt_tokens"] < len(ids)
    text = engine.classify("The quick brown fox")
    assert text["scores"] == pytest.approx(engine.classify(
        input_ids=engine.tokenizer.encode("The quick brown fox"))["scores"], abs=ATOL)


BAD = {
    "empty prompt": lambda e: e.classify(""),
    "empty ids": lambda e: e.classify(input_ids=[]),
    "id out of vocabulary": lambda e: e.classify(input_ids=[1, 10**6]),
    "two prompt kinds": lambda e: e.classify("x", input_ids=[1]),
    "class out of range": lambda e: e.classify("x", returned_token_ids=[1]),
    "negative step tag": lambda e: e.classify("x", step_tag_id=-1),
    "activation not a bool": lambda e: e.classify("x", activation="yes"),
    "generate on a reward model": lambda e: e.generate("x", {"max_new_tokens": 2}),
    "async generate on a reward model": lambda e: asyncio.run(e.async_generate("x")),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_value_error_and_the_engine_keeps_serving(engine, case):
    before = engine.classify(input_ids=[5, 6, 7])["scores"]
    with pytest.raises(ValueError):
        BAD[case](engine)
    assert engine.classify(input_ids=[5, 6, 7])["scores"] == pytest.approx(before, abs=ATOL)


def test_classify_on_a_generating_model_is_a_value_error(tmp_path):
    with Engine(write_tiny_chat_model(str(tmp_path)), **KW) as engine:
        with pytest.raises(ValueError, match="reward model"):
            engine.classify("x")
        assert engine.generate("x", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_a_weight_update_moves_the_scores_and_the_version(engine):
    ids = [9, 8, 7, 6, 5]
    first = engine.classify(input_ids=ids)
    head = torch.tensor(engine.get_weights_by_name("score.weight", 1000)).reshape(1, -1)
    assert engine.update_weights_from_tensor({"score.weight": 2 * head},
                                             weight_version="v2")["success"]
    second = engine.classify(input_ids=ids)
    assert second["meta_info"]["weight_version"] == "v2"
    assert second["meta_info"]["cached_tokens"] == 0  # the old version's KV is not read
    assert second["scores"][0] == pytest.approx(2 * first["scores"][0], abs=ATOL)
    assert engine.update_weights_from_tensor({"score.weight": head})["success"]
    assert engine.classify(input_ids=ids)["scores"] == pytest.approx(first["scores"], abs=ATOL)


def test_remote_engine_and_router_score_as_the_engine(engine):
    batch = [[5, 6, 7], [9, 8, 7, 6, 5, 4]]
    want = engine.classify(input_ids=batch, activation=True)
    with serve(engine) as server:
        for client in (RemoteEngine(server.url), Router([server.url])):
            with client:
                outs = client.classify(input_ids=batch, activation=True)
                torch.testing.assert_close(torch.tensor([o["scores"] for o in outs]),
                                           torch.tensor([o["scores"] for o in want]),
                                           atol=ATOL, rtol=0)
                one = asyncio.run(client.async_classify(input_ids=batch[0], rid="r1"))
                assert one["meta_info"]["id"] == "r1"
                assert one["scores"] == pytest.approx(
                    engine.classify(input_ids=batch[0])["scores"], abs=ATOL)
                with pytest.raises(ValueError):
                    client.classify(input_ids=[1, 10**6])
                with pytest.raises(ValueError):
                    client.generate("x")


@pytest.mark.slow
def test_a_ray_fleet_scores_as_the_engine(engine, reward_path):
    ray = pytest.importorskip("ray")
    from hotswap.fleet import RayFleet

    batch = [[5, 6, 7], [9, 8, 7, 6, 5, 4]]
    want = torch.tensor([o["scores"] for o in engine.classify(input_ids=batch)])
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        with RayFleet(reward_path, replicas=1, engine_kwargs=KW) as fleet:
            outs = fleet.classify(input_ids=batch)
            torch.testing.assert_close(torch.tensor([o["scores"] for o in outs]), want,
                                       atol=ATOL, rtol=0)
            one = asyncio.run(fleet.async_classify(input_ids=batch[1], step_tag_id=7))
            assert len(one["step_scores"]) == 1
            with pytest.raises(ValueError):
                fleet.generate("x")
    finally:
        ray.shutdown()
