"""The learned draft's training side: reference module, online trainer, checkpoint, warm start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from fixtures import write_tiny_chat_model

from hotswap.engine.models.draft import draft_shapes, load_draft_config, save_draft
from hotswap.engine.speculative import draft_data
from hotswap.engine.speculative.train_draft import (
    PROPOSAL_SCALES,
    DraftNet,
    DraftTrainer,
    calibrate_proposal,
    evaluate,
    load_draft,
    policy_weights_sha,
)

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> transformers.PreTrainedModel:
    path = write_tiny_chat_model(str(tmp_path_factory.mktemp("policy")))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # peaked next-token distributions, as a trained policy has
        model.lm_head.weight.mul_(8.0)
    model.name_or_path = path
    return model


def policy_batch(model: transformers.PreTrainedModel, rows: int, length: int,
                 seed: int) -> dict[str, torch.Tensor]:
    """Sequences sampled from the policy, with its features and full-vocab logits."""
    torch.manual_seed(seed)
    prompt = torch.randint(3, model.config.vocab_size, (rows, 2))
    with torch.no_grad():
        ids = model.generate(input_ids=prompt, do_sample=True, top_k=0, top_p=1.0,
                             max_new_tokens=length - 2, min_new_tokens=length - 2,
                             pad_token_id=0)
        feats = model.get_decoder()(input_ids=ids).last_hidden_state
        logits = model.get_output_embeddings()(feats)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, -1] = False
    return {"input_ids": ids, "features": feats, "policy_logits": logits, "loss_mask": mask}


def all_tokens(model: transformers.PreTrainedModel) -> list[int]:
    return list(range(model.config.vocab_size))


def test_named_tensors_match_the_checkpoint_names_and_shapes(policy):
    net = DraftNet(policy.config, [2, 5, 9])
    named = dict(net.named_tensors(torch.bfloat16))
    want = draft_shapes(net.config)
    assert {n: tuple(t.shape) for n, t in named.items()} == want
    assert want["draft.fc.weight"] == (64, 128)
    assert want["draft.layer.self_attn.k_proj.weight"] == (2 * 16, 64)  # GQA: 2 kv heads
    assert all(t.dtype == torch.bfloat16 for t in named.values())


def test_draft_layer_matches_the_policy_layer_it_was_copied_from(policy):
    """With z = E[x] + F_{s-1} (the initial fc) the draft is HF's last decoder layer + norm."""
    net = DraftNet(policy.config, all_tokens(policy)).init_from_policy(policy)
    ids = torch.randint(0, policy.config.vocab_size, (2, 12))
    feats = torch.randn(2, 12, 64)
    embed, head = policy.get_input_embeddings().weight, policy.get_output_embeddings().weight
    with torch.no_grad():
        g, logits = net(ids, feats, head, embed_weight=embed)
        shifted = torch.cat([torch.zeros(2, 1, 64), feats[:, :-1]], dim=1)
        z = embed[ids] + shifted
        pos = torch.arange(12).expand(2, 12)
        causal = torch.full((12, 12), float("-inf")).triu(1)[None, None]
        ref = policy.model.layers[-1](z, attention_mask=causal, position_ids=pos,
                                      position_embeddings=policy.model.rotary_emb(z, pos))
        ref = policy.model.norm(ref[0] if isinstance(ref, tuple) else ref)
    torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref @ head.T, atol=1e-4, rtol=1e-4)


def test_padded_and_packed_rows_equal_separate_sequences(policy):
    net = DraftNet(policy.config, all_tokens(policy)).init_from_policy(policy)
    head, embed = policy.get_output_embeddings().weight, policy.get_input_embeddings().weight
    ids = torch.randint(0, policy.config.vocab_size, (1, 14))
    feats = torch.randn(1, 14, 64)
    with torch.no_grad():
        first, _ = net(ids[:, :9], feats[:, :9], head, embed_weight=embed)
        second, _ = net(ids[:, 9:], feats[:, 9:], head, embed_weight=embed)
        packed, _ = net(ids, feats, head, embed_weight=embed,
                        position_ids=torch.cat([torch.arange(9), torch.arange(5)])[None])
        mask = torch.ones(1, 14, dtype=torch.long)
        mask[:, :9] = 0  # left padding before the second sequence
        padded, _ = net(ids, feats, head, attention_mask=mask, embed_weight=embed)
    torch.testing.assert_close(packed[:, :9], first)
    torch.testing.assert_close(packed[:, 9:], second, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[:, 9:], second, atol=1e-5, rtol=1e-5)


def test_grpo_units_equal_each_response_as_its_own_sequence(policy):
    """A unit row (a prompt once, each response continuing it, as the trainer packs them) gives
    at every level the outputs of prompt + response run alone, prompt positions included."""
    net = DraftNet(policy.config, all_tokens(policy))
    head, embed = policy.get_output_embeddings().weight, policy.get_input_embeddings().weight
    torch.manual_seed(0)
    prompt, lengths = 5, [4, 1, 6]
    width = prompt + sum(lengths) + 2  # two columns of padding
    ids = torch.randint(0, policy.config.vocab_size, (1, width))
    feats = torch.randn(1, width, 64)
    segments = torch.tensor([[0] * prompt + [k + 1 for k, n in enumerate(lengths)
                                              for _ in range(n)] + [-1, -1]])
    positions = torch.tensor([list(range(prompt)) + [prompt + i for n in lengths
                                                     for i in range(n)] + [0, 0]])
    with torch.no_grad():
        units = net.forward_levels(ids, feats, head, 3, positions, segments >= 0,
                                   embed_weight=embed, segments=segments)
        for k in range(len(lengths)):
            cols = torch.cat([torch.arange(prompt), (segments[0] == k + 1).nonzero()[:, 0]])
            alone = net.forward_levels(ids[:, cols], feats[:, cols], head, 3,
                                       embed_weight=embed)
            for level, (unit, own) in enumerate(zip(units, alone), start=1):
                valid = slice(level - 1, None)  # chains that start inside the sequence
                torch.testing.assert_close(unit.features[0, cols][valid],
                                           own.features[0][valid], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(unit.logits[0, cols][valid], own.logits[0][valid],
                                           atol=1e-4, rtol=1e-4)


def test_chained_levels_follow_the_draft_own_features(policy):
    """Level 2 at t is step 2 of the chain from t-1: the same as a teacher-forced pass over the
    prefix up to t-1 whose last feature is replaced by level 1's G at t-1."""
    net = DraftNet(policy.config, all_tokens(policy)).init_from_policy(policy)
    head, embed = policy.get_output_embeddings().weight, policy.get_input_embeddings().weight
    ids = torch.randint(0, policy.config.vocab_size, (1, 10))
    feats = torch.randn(1, 10, 64)
    t = 6
    with torch.no_grad():
        level1, level2 = net.forward_levels(ids, feats, head, 2, embed_weight=embed)
        chained = feats[:, :t + 1].clone()
        chained[:, t - 1] = level1.features[:, t - 1]
        alone, _ = net(ids[:, :t + 1], chained, head, embed_weight=embed)
    torch.testing.assert_close(level2.features[:, t], alone[:, t], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(level2.features[:, t], level1.features[:, t], atol=1e-3)


def test_save_and_load_round_trip(policy, tmp_path):
    net = DraftNet(policy.config, [2, 7, 40]).init_from_policy(policy)
    save_draft(str(tmp_path), net.named_tensors(), [2, 7, 40], policy.config.to_dict(),
               trained_tokens=123, policy_path="p", weights_sha=policy_weights_sha(policy))
    config = load_draft_config(str(tmp_path), policy.config.to_dict())
    assert config["format"] == "hotswap-draft" and config["format_version"] == 1
    assert config["token_map"] == [2, 7, 40] and config["trained_tokens"] == 123
    assert config["vocab_size"] == policy.config.vocab_size and config["num_kv_heads"] == 2
    assert config["policy"] == {"path": "p", "weights_sha": policy_weights_sha(policy)}
    loaded, _ = load_draft(str(tmp_path), policy.config)
    for (name, a), (_, b) in zip(net.named_tensors(), loaded.named_tensors()):
        assert torch.equal(a, b), name


def test_load_errors_name_the_file_and_the_problem(policy, tmp_path):
    cfg = policy.config.to_dict()
    with pytest.raises(ValueError, match="missing file .*config.json"):
        load_draft_config(str(tmp_path))
    net = DraftNet(policy.config, [2, 3])
    save_draft(str(tmp_path), net.named_tensors(), [2, 3], cfg)
    config_path = os.path.join(tmp_path, "config.json")
    with open(config_path) as f:
        good = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**good, "format": "eagle"}, f)
    with pytest.raises(ValueError, match="config.json: 'format' must be 'hotswap-draft'"):
        load_draft_config(str(tmp_path))
    with open(config_path, "w") as f:
        json.dump(good, f)
    wider = {**cfg, "hidden_size": 128, "head_dim": 16}
    with pytest.raises(ValueError, match="does not fit the policy: hidden_size 64"):
        load_draft_config(str(tmp_path), wider)
    with pytest.raises(ValueError, match="draft.fc.weight"):
        save_draft(str(tmp_path / "bad"), [(n, t[:1]) for n, t in net.named_tensors()], [2], cfg)
    shrunk = dict(net.named_tensors())
    shrunk["draft.layer.mlp.up_proj.weight"] = torch.zeros(5, 64)
    from safetensors.torch import save_file
    save_file(shrunk, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors.*up_proj.weight \(5, 64\)"):
        load_draft_config(str(tmp_path), cfg)
    os.remove(os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match="missing file .*model.safetensors"):
        load_draft_config(str(tmp_path))


def test_trainer_steps_lower_the_loss_and_raise_acceptance(policy):
    batch = policy_batch(policy, rows=4, length=24, seed=0)
    trainer = DraftTrainer(policy, all_tokens(policy), lr=3e-3)
    stats = [trainer.step(batch["input_ids"], batch["features"], batch["policy_logits"],
                          batch["loss_mask"]) for _ in range(30)]
    assert stats[-1]["loss"] < 0.8 * stats[0]["loss"]
    assert stats[-1]["acceptance_estimate"] > stats[0]["acceptance_estimate"] + 0.05
    assert all(s["seconds"] > 0 for s in stats)
    assert trainer.trained_tokens == 30 * int(batch["loss_mask"].sum())
    named = dict(trainer.named_tensors())
    assert set(named) == set(draft_shapes(trainer.net.config))
    assert not any(t.requires_grad for t in named.values())


def test_trainer_without_policy_logits_uses_the_head(policy):
    """Without logits the target comes from W F (over token_map): the same gradient step as
    when the logits are passed, when the map is the whole vocabulary."""
    batch = policy_batch(policy, rows=2, length=12, seed=1)
    results = []
    for logits in (batch["policy_logits"], None):
        torch.manual_seed(0)
        trainer = DraftTrainer(policy, all_tokens(policy), lr=1e-3)
        results.append(trainer.step(batch["input_ids"], batch["features"], logits,
                                    batch["loss_mask"]))
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-4)
    assert results[0]["acceptance_estimate"] == pytest.approx(
        results[1]["acceptance_estimate"], rel=1e-4)


def test_evaluate_trained_draft_beats_untrained(policy):
    train = [policy_batch(policy, rows=4, length=24, seed=s) for s in range(3)]
    held = [policy_batch(policy, rows=4, length=24, seed=10)]
    head, embed = policy.get_output_embeddings().weight, policy.get_input_embeddings().weight
    untrained = DraftNet(policy.config, all_tokens(policy))  # random init, not the policy's
    before = evaluate(untrained, held, head, embed, k=4)
    trainer = DraftTrainer(policy, all_tokens(policy), lr=1e-2, net=untrained)
    for _ in range(20):
        for b in train:
            trainer.step(b["input_ids"], b["features"], b["policy_logits"], b["loss_mask"])
    after = evaluate(trainer.net, held, head, embed, k=4)
    for result in (before, after):
        assert all(0 <= a <= 1 for a in result.level_acceptance)
        assert result.positions == 4 * (23 - 3)  # chain starts with all 4 steps in the mask
        # a_1 <= a_1 + a_1 a_2 + ... <= 4 a_1, start by start.
        assert result.acceptance <= result.chained_length <= 4 * result.acceptance + 1e-6
    assert after.acceptance > before.acceptance + 0.05
    assert after.chained_length > before.chained_length + 0.05


@pytest.mark.parametrize("sharpness", [0.6, 0.8])
def test_calibration_finds_the_proposal_temperature_that_matches_the_policy(policy, sharpness):
    """A policy whose next-token distribution is the draft's own at temperature `sharpness`:
    one-step acceptance is sum min(p, q) = 1 at that proposal scale, and below 1 elsewhere."""
    net = DraftNet(policy.config, all_tokens(policy))
    batch = policy_batch(policy, rows=3, length=12, seed=4)
    head, embed = policy.get_output_embeddings().weight, policy.get_input_embeddings().weight
    with torch.no_grad():
        (level,) = net.forward_levels(batch["input_ids"], batch["features"], head, 1,
                                      embed_weight=embed)
    batch["policy_logits"] = level.logits / sharpness  # the map is the whole vocabulary
    scale, result = calibrate_proposal(net, [batch], head, embed, k=1)
    assert scale == sharpness
    assert result.acceptance > 0.999
    for other in PROPOSAL_SCALES:
        if other != sharpness:
            assert evaluate(net, [batch], head, embed, k=1, proposal_scale=other).acceptance < 0.99


def test_token_map_keeps_eos_and_the_most_emitted_tokens():
    rollouts = [([5, 6], [9, 9, 9, 8, 2]), ([5], [9, 8, 7])]
    assert draft_data.choose_token_map(rollouts, 100, 3, eos=[2]) == [2, 8, 9]
    # Filled up from the prompts' tokens, then the lowest free ids.
    assert draft_data.choose_token_map(rollouts, 100, 8, eos=[2]) == [0, 1, 2, 5, 6, 7, 8, 9]


def test_task_prompts_come_from_the_file_or_the_grpo_job(tmp_path):
    assert all("+" in chat[0]["content"] for chat in draft_data.task_chats(8, seed=0))
    path = tmp_path / "task.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    path.write_text(json.dumps({"messages": chat}) + "\n\n" + json.dumps({"prompt": "Sum 2+2"})
                    + "\n")
    drawn = draft_data.task_chats(20, seed=1, path=str(path))
    assert len(drawn) == 20 and chat in drawn
    assert [{"role": "user", "content": "Sum 2+2"}] in drawn
    path.write_text(json.dumps({"text": "no prompt key"}) + "\n")
    with pytest.raises(ValueError, match=r"task.jsonl:1: expected a JSON object"):
        draft_data.task_chats(2, seed=0, path=str(path))


def test_the_policy_writes_user_turns_from_its_own_template(policy):
    from hotswap.engine.draft_warm_start import written_prompts
    from hotswap.engine.engine import Engine

    tokenizer = transformers.AutoTokenizer.from_pretrained(policy.name_or_path)
    head, close = draft_data.user_turn(tokenizer)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert rendered == tokenizer.decode(head) + "x" + tokenizer.decode(close)
    with Engine(policy.name_or_path, dtype="float32", seed=0) as engine:
        texts = written_prompts(engine, tokenizer, 6, 1.0, seed=0, max_tokens=8)
    assert len(texts) == 6 and all(t and t == t.strip() for t in texts)
    assert len(set(texts)) > 1  # seeded draws, not one prompt six times


@pytest.mark.slow
def test_warm_start_cli_end_to_end(policy, tmp_path):
    out = tmp_path / "draft"
    proc = subprocess.run(
        [sys.executable, "-m", "hotswap.engine.speculative.train_draft", policy.name_or_path,
         "--out", str(out), "--minutes", "0.2", "--samples", "16", "--max-new-tokens", "16"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "epoch   1" in proc.stdout and f"saved the draft to {out}" in proc.stdout
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 < summary["acceptance"] <= 1 and 0 < summary["chained_k4"] <= 4
    config = load_draft_config(str(out), policy.config.to_dict())
    assert 2 in config["token_map"] and config["trained_tokens"] > 0
    assert config["proposal_scale"] == summary["proposal_scale"] in PROPOSAL_SCALES
    on_disk = transformers.AutoModelForCausalLM.from_pretrained(policy.name_or_path)
    assert config["policy"]["weights_sha"] == policy_weights_sha(on_disk)
