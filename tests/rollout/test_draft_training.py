"""The GRPO job with a learned draft (--speculative draft): the trainer trains the draft on the
states of its own forward, on its packed units, and every push carries the draft with the
policy under one version; --freeze-draft leaves it stale."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from fixtures import write_tiny_chat_model
from test_rollout_grpo import grpo_batch, varied_reward

from hotswap.engine.config import ModelConfig
from hotswap.engine.models.draft import save_draft
from hotswap.engine.speculative.train_draft import DraftNet, DraftTrainer
from hotswap.rollout import grpo
from hotswap.rollout.grpo import draft_trainer, parse_args, run
from hotswap.rollout.trainer import Trainer


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = write_tiny_chat_model(str(tmp_path_factory.mktemp("draft-grpo")))
    policy = transformers.AutoModelForCausalLM.from_pretrained(path)
    cfg = ModelConfig.from_path(path)
    token_map = list(range(cfg.vocab_size))
    net = DraftNet(cfg, token_map).init_from_policy(policy)
    save_draft(os.path.join(path, "draft"), net.named_tensors(), token_map, cfg)
    return path


def test_the_draft_trains_on_the_packed_units(model_path, monkeypatch):
    """What the draft step gets: the trainer's packed units, each prompt once with its responses
    continuing it (`segments`); along each response's path (the prompt, then its segment) the
    ids are prompt + response as packed, the states those of a forward over that sequence
    alone, and the loss covers the positions that predict a response token."""
    seen = {}
    step = DraftTrainer.step

    def spy(self, ids, features, logits, mask, **kwargs):
        seen.update(ids=ids, features=features, mask=mask, **kwargs)
        return step(self, ids, features, logits, mask, **kwargs)

    monkeypatch.setattr(DraftTrainer, "step", spy)
    args = parse_args(["--model-path", model_path, "--speculative", "draft"])
    trainer = Trainer(model_path, lr=0.0, clip=0.2, temperature=1.0, micro_batch=4,
                      dtype="float32", pad_id=2, draft=draft_trainer(args, model_path))
    batch = grpo_batch(trainer.model, seed=3)
    metrics = trainer.step(batch)
    assert metrics["time/draft_train_s"] > 0 and metrics["draft/loss"] > 0
    # as packed: a response without its last token (a 1-token response adds no position)
    rows = {(tuple(t.prompt_ids), tuple(t.response_ids[:-1])) for t in batch.trajectories}
    segments = seen["segments"]
    assert len(segments) < len(batch.trajectories)  # prompts shared, not one row per sample
    assert torch.equal(seen["attention_mask"], segments >= 0)
    decoder, paths = trainer.model.get_decoder(), set()
    for n, row in enumerate(segments):
        prompt = (row == 0).nonzero()[:, 0]
        assert torch.equal(prompt, torch.arange(len(prompt)))
        for k in range(1, int(row.max()) + 1):
            cols = torch.cat([prompt, (row == k).nonzero()[:, 0]])
            seq = seen["ids"][n, cols].tolist()
            assert seen["position_ids"][n, cols].tolist() == list(range(len(seq)))
            match = [(p, r) for p, r in rows if list(p + r) == seq]
            assert match, seq
            paths.add(tuple(seq))
            mask = seen["mask"][n, cols].nonzero()[:, 0].tolist()
            assert mask == list(range(len(match[0][0]) - 1, len(seq)))
            with torch.no_grad():  # lr 0: the policy's step left its states as they were
                want = decoder(input_ids=torch.tensor([seq])).last_hidden_state[0]
            assert torch.allclose(seen["features"][n, cols], want, atol=1e-4)
        assert not seen["mask"][n][row < 0].any()
    assert {p + r for p, r in rows if r} <= paths
    names = [n for n, _ in trainer.named_weights()]
    assert "draft.fc.weight" in names and "draft.norm.weight" in names


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True])
def test_the_job_pushes_the_draft_with_the_policy(model_path, tmp_path, monkeypatch, frozen):
    states = []
    train_and_push = grpo.train_and_push

    def spy(args, step, batch, trainer, handle, client):
        metrics = train_and_push(args, step, batch, trainer, handle, client)
        states.append((handle.backend.get_weight_version(),
                       handle.backend.get_load()["speculative"]))
        return metrics

    monkeypatch.setattr(grpo, "train_and_push", spy)
    argv = ["--model-path", model_path, "--steps", "2", "--prompts", "2", "--group-size", "4",
            "--over-sample", "0", "--max-new-tokens", "12", "--lr", "1e-3", "--speculative",
            "draft", "--wandb-dir", str(tmp_path), "--quiet"]
    out = run(parse_args(argv + (["--freeze-draft"] if frozen else [])), reward=varied_reward)
    assert [v for v, _ in states] == ["1", "2"]
    for version, spec in states:
        assert spec["stale"] == frozen
        assert spec["draft_version"] == ("0" if frozen else version)
    for h in out["history"]:
        assert h["mismatch/abs_diff"] < 1e-4  # the push served exactly the trainer's policy
        assert ("draft/loss" in h) != frozen
        assert h["spec/draft_stale"] == float(frozen and h["weight_version"] > 0)
        assert "spec/draft_acceptance" in h
