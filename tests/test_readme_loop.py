"""The README's "From a trainer" loop as written: an engine served over HTTP, a trainer that
generates, takes a step and pushes its weights over gloo with weight_version=f"step-{step}",
for long enough that "step-10" follows "step-9". The rollout layer then orders the versions,
and counts their staleness, as they were pushed."""

from __future__ import annotations

import pytest
from fixtures import serve, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine, RemoteEngine
from hotswap.rollout import RolloutBatch, SingleTurn, TokenClient, collect
from hotswap.rollout.tracking import batch_metrics
from hotswap.weight_sync import WeightSender
from hotswap.weight_sync.group import free_port

ADMIN_KEY = "admin"
STEPS = 12
LABELS = ["0", *(f"step-{k}" for k in range(STEPS))]  # the engine's first, then the trainer's


def test_the_readme_trainer_loop_keeps_step_labels_in_order(tmp_path):
    path = write_tiny_chat_model(str(tmp_path / "model"))
    weights = load_file(f"{path}/model.safetensors")
    rows = [{"input_ids": [5, 9, 33, 40 + i]} for i in range(2)]
    batches = []
    with Engine(path, device="cpu", max_total_tokens=4096) as served, \
            serve(served, admin_key=ADMIN_KEY) as server:
        engine = RemoteEngine(server.url, admin_key=ADMIN_KEY)
        sender = WeightSender("127.0.0.1", free_port(), world_size=1 + engine.weight_sync_ranks,
                              backend="gloo", timeout_s=60)
        client = TokenClient(engine, sampling={"max_new_tokens": 3, "temperature": 1.0,
                                               "ignore_eos": True})
        try:
            for step in range(STEPS):
                batch = collect(client, SingleTurn(), rows, group_size=2)
                batches.append(batch)
                metrics = batch_metrics(batch, client.weight_version(), client.versions)
                assert metrics["staleness/version_lag_max"] == 0  # counted, not dropped
                weights = {n: t * 1.01 for n, t in weights.items()}  # train_step(model, outs)
                sender.send(weights.items(), [engine], weight_version=f"step-{step}")
                assert client.weight_version() == f"step-{step}"
            proposed = sender.send(weights.items(), [engine])  # weight_version=None
        finally:
            sender.close([engine])
    assert proposed[0]["weight_version"] == "step-12"  # the engine's next label after step-11
    assert [b.meta["weight_version"] for b in batches] == LABELS[:STEPS]
    assert client.versions.labels == LABELS  # "step-10" after "step-9"
    assert client.versions.lag("step-10", "0") == 11

    trajs = [t for b in batches for t in b.trajectories]
    merged = RolloutBatch.from_trajectories(trajs, [0.0] * len(trajs))
    codes = merged.to_tensors(pad_id=0)["weight_versions"].tolist()
    for row, versions in zip(codes, merged.weight_versions):
        assert row == [LABELS.index(v) for v in versions]  # ordered as pushed
    metrics = batch_metrics(merged, "step-11", client.versions)
    assert metrics["staleness/version_lag_max"] == 12  # "0" is 12 pushes behind "step-11"
    assert metrics["staleness/version_lag_mean"] == pytest.approx(sum(range(1, 13)) / 12)
