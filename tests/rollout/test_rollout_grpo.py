"""The main job (`python -m hotswap.rollout.grpo`) for 3 steps on a tiny random model."""

from __future__ import annotations

import glob
import json
import math
import os
import struct

import pytest
from fixtures import write_tiny_chat_model

from hotswap.rollout.grpo import parse_args, run


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("grpo-chat")))


def wandb_history(run_dir: str) -> list[dict]:
    """History rows from an offline run file (LevelDB-style log of wandb Record protos)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:4] == b":W&B"
    block, pos, buf, rows = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos: pos + 7])
        buf, pos = buf + raw[pos + 7: pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record or the last fragment of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in rec.history.item})
            buf = b""
    return rows


def varied_reward(traj) -> float:
    """Something a random model's samples differ in, so every step has a gradient."""
    return sum(t % 2 for t in traj.response_ids) / max(1, len(traj.response_ids))


@pytest.mark.slow
def test_three_grpo_steps_push_live_weights_and_write_wandb_offline(model_path, tmp_path,
                                                                    monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args = parse_args(["--model-path", model_path, "--steps", "3", "--prompts", "2",
                       "--group-size", "4", "--over-sample", "0", "--max-new-tokens", "6",
                       "--lr", "1e-3", "--wandb-dir", str(tmp_path), "--quiet"])
    out = run(args, reward=varied_reward)
    history = out["history"]
    assert [h["weight_version"] for h in history] == [0, 1, 2]  # one push per step
    for h in history:
        assert h["batch/trajectories"] == 8
        assert h["train/grad_norm"] > 0  # the step did move the weights
        # the engine's logprobs are the trainer's own: the push served exactly its weights
        assert h["mismatch/abs_diff"] < 1e-4 and h["mismatch/kl"] < 1e-6
        assert h["staleness/version_lag_max"] == 0
    assert out["run_dir"].startswith(str(tmp_path)) and "offline-run" in out["run_dir"]
    rows = wandb_history(out["run_dir"])
    assert [r["_step"] for r in rows] == [0, 1, 2]
    for key in ("reward/mean", "reward/std", "response/length", "rollout/tokens_per_s",
                "rollout/cache_hit_rate", "time/weight_sync_s", "staleness/version_lag_max",
                "mismatch/abs_diff", "mismatch/kl", "samples/_type"):
        assert all(key in r for r in rows), key
    for r, h in zip(rows, history):
        assert math.isclose(r["reward/mean"], h["reward/mean"], rel_tol=1e-9)
    assert rows[0]["samples/_type"] == "table-file"
    assert glob.glob(os.path.join(out["run_dir"], "files", "media", "table", "samples_*.json"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_int8_rollouts_with_importance_sampling(model_path, tmp_path, mode):
    """An int8 engine's logprobs differ from the float32 trainer's; --tis weights the loss and
    the share of truncated tokens is logged."""
    args = parse_args(["--model-path", model_path, "--steps", "2", "--prompts", "2",
                       "--group-size", "4", "--over-sample", "0", "--max-new-tokens", "6",
                       "--lr", "1e-3", "--wandb-dir", str(tmp_path), "--quiet",
                       "--quantization", "int8", "--tis", "2", "--tis-mode", mode])
    history = run(args, reward=varied_reward)["history"]
    assert [h["weight_version"] for h in history] == [0, 1]
    for h in history:
        assert h["mismatch/abs_diff"] > 1e-4  # int8 rollouts: a real mismatch, measured
        assert 0.0 <= h["mismatch/tis_truncated"] <= 1.0
        assert h["train/grad_norm"] > 0


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    for option in ("--steps", "--transport", "--async", "--max-staleness", "--wandb-dir",
                   "--group-size", "--lr", "--filter", "--quantization", "--tis",
                   "--routing-replay", "--model"):
        assert option in text


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--async"]])
def test_async_mode(model_path, tmp_path, mode):
    args = parse_args(["--model-path", model_path, "--steps", "2", "--prompts", "2",
                       "--group-size", "2", "--over-sample", "0", "--max-new-tokens", "4",
                       "--lr", "1e-3", "--wandb-dir", str(tmp_path), "--quiet", *mode])
    history = run(args, reward=varied_reward)["history"]
    assert [h["weight_version"] for h in history] == [0, 1]
    # step 0 trains on version-0 samples with version-0 weights: the logprobs agree; later
    # batches may hold tokens one version old (off-policy, corrected by the ratio)
    assert history[0]["mismatch/abs_diff"] < 1e-4
    for h in history:
        assert h["time/weight_sync_s"] > 0 and h["batch/trajectories"] == 4
        assert h["staleness/version_lag_max"] <= args.max_staleness


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tensor", "gloo"])
def test_the_job_on_a_ray_fleet_of_two_replicas(model_path, tmp_path, transport):
    pytest.importorskip("ray")
    args = parse_args(["--model-path", model_path, "--steps", "2", "--prompts", "4",
                       "--group-size", "2", "--over-sample", "0", "--max-new-tokens", "4",
                       "--lr", "1e-3", "--wandb-dir", str(tmp_path), "--quiet",
                       "--fleet", "ray", "--replicas", "2", "--transport", transport])
    history = run(args, reward=varied_reward)["history"]
    assert [h["weight_version"] for h in history] == [0, 1]
    for step, h in enumerate(history):
        # both replicas serve the trainer's weights exactly, at the step's version
        assert h["mismatch/abs_diff"] < 1e-4
        cells = h["fleet/replicas"].split(" | ")
        assert len(cells) == 2 and all(f" v{step + 1} s" in c for c in cells), cells
    assert sum(h["replica/0/requests"] + h["replica/1/requests"] for h in history) == 16


@pytest.mark.real_model
@pytest.mark.slow
def test_routing_replay_on_the_tiny_moe_the_repository_writes(tmp_path):
    """examples/make_tiny_moe.py's folder, --routing-replay: the engine's routes replayed in the
    trainer's forward (same weights, fp32), so the rollout-vs-trainer gap stays at fp32 noise."""
    import subprocess
    import sys

    from fixtures import TESTS_DIR

    folder = str(tmp_path / "tiny-moe")
    script = os.path.join(TESTS_DIR, "..", "examples", "make_tiny_moe.py")
    subprocess.run([sys.executable, script, "--out", folder], check=True)
    args = parse_args(["--model", folder, "--routing-replay", "--steps", "3", "--prompts", "2",
                       "--group-size", "4", "--over-sample", "0", "--max-new-tokens", "8",
                       "--filter", "none", "--lr", "1e-3", "--wandb-dir", str(tmp_path),
                       "--quiet"])
    history = run(args, reward=varied_reward)["history"]
    assert [h["weight_version"] for h in history] == [0, 1, 2]
    for h in history:
        assert h["mismatch/abs_diff"] < 1e-4
        assert 0 <= h["mismatch/routes_differ"] < 0.05
