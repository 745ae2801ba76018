"""RemoteEngine against a live server: the Engine's methods, errors, and WeightSender targets."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from fixtures import serve, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine, RemoteEngine
from hotswap.engine.errors import WeightsIncompleteError
from hotswap.weight_sync import WeightSender
from hotswap.weight_sync.group import WeightSyncError, free_port

API_KEY = "remote-api"
ADMIN_KEY = "remote-admin"
PROMPT = "Hello, how are you?"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_chat_model(str(tmp_path_factory.mktemp("chat")))
    with Engine(path, device="cpu", max_total_tokens=8192) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with serve(engine, api_key=API_KEY, admin_key=ADMIN_KEY) as srv:
        yield srv


@pytest.fixture
def remote(server):
    with RemoteEngine(server.url, api_key=API_KEY, admin_key=ADMIN_KEY) as r:
        yield r


def test_generate_batch_matches_engine(engine, remote):
    params = [{"max_new_tokens": 6, "seed": 1}, {"max_new_tokens": 4, "seed": 2, "n": 2}]
    prompts = [PROMPT, "The quick brown fox"]
    engine.flush_cache()
    want = engine.generate(prompt=prompts, sampling_params=params)
    engine.flush_cache()
    got = remote.generate(prompt=prompts, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["meta_info"]["completion_tokens"] for o in got] == [6, 4, 4]


def test_async_generate_and_stream(engine, remote):
    async def run():
        one = await remote.async_generate(input_ids=[5, 6, 7],
                                          sampling_params={"max_new_tokens": 5, "seed": 3})
        events = await remote.async_generate(input_ids=[5, 6, 7], stream=True,
                                             sampling_params={"max_new_tokens": 5, "seed": 3})
        return one, [e async for e in events]

    engine.flush_cache()
    one, events = asyncio.run(run())
    assert [t for e in events for t in e["output_ids"]] == one["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_errors_map_to_python_exceptions(server, remote):
    with pytest.raises(ValueError, match="max_new_tokens"):
        remote.generate(prompt=PROMPT, sampling_params={"max_new_tokens": -1})
    with pytest.raises(ValueError, match="unknown key"):
        list(remote.generate(prompt=PROMPT, sampling_params={"nope": 1}, stream=True))
    with pytest.raises(ValueError, match="pause_mode"):
        remote.update_weights_from_disk("/x", pause_mode="sideways")
    with pytest.raises(PermissionError):
        RemoteEngine(server.url, api_key="wrong").generate(prompt=PROMPT)
    with pytest.raises(PermissionError):
        RemoteEngine(server.url, api_key=API_KEY).flush_cache()
    with pytest.raises(ValueError):
        remote.release_memory_occupation(["gpu"])
    assert remote.release_memory_occupation(["kv_cache"])["success"]
    assert remote.resume_memory_occupation(["kv_cache"])["success"]
    # Tensors travel in the body now (base64 safetensors); a bad one is refused by name.
    with pytest.raises(ValueError, match="unexpected tensor 'x'"):
        remote.update_weights_from_tensor({"x": torch.zeros(1)})
    assert repr(remote) == f"RemoteEngine('{server.url}')"


def test_breaking_off_a_stream_aborts_the_request(engine, remote):
    events = remote.generate(prompt=PROMPT, stream=True,
                             sampling_params={"max_new_tokens": 200, "ignore_eos": True})
    next(events)
    assert remote.pause_generation("in_place")["success"]  # holds it mid-generation
    assert len(engine.scheduler.running) == 1
    events.close()
    deadline = time.monotonic() + 10
    while engine.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.scheduler.running
    assert remote.continue_generation()["success"]
    remote.check_integrity()


def test_control_methods(engine, remote):
    assert remote.health()["status"] == "ok"
    assert remote.pause_generation("retract")["success"] and engine.scheduler.paused
    assert remote.continue_generation()["success"] and not engine.scheduler.paused
    assert remote.flush_cache()["success"]
    remote.abort_request(abort_all=True)
    assert remote.get_weights_by_name("model.norm.weight", 4) == pytest.approx(
        engine.get_weights_by_name("model.norm.weight", 4))
    assert "hotswap_weight_version_info" in remote.get_metrics()


def test_weight_sender_targets_a_remote_engine(engine, remote, tmp_path):
    new = load_file(f"{write_tiny_chat_model(str(tmp_path / 'new'), seed=5)}/model.safetensors")
    sender = WeightSender("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=60)
    try:
        replies = sender.send(new, [remote], weight_version="remote-1")
        assert replies == [{"success": True, "message": "updated to version 'remote-1'",
                            "weight_version": "remote-1"}]
        assert remote.get_weight_version() == "remote-1"
        for name in ("model.norm.weight", "model.layers.1.mlp.down_proj.weight"):
            got = torch.tensor(remote.get_weights_by_name(name, 2))
            assert torch.equal(got, new[name][:2])
        out = remote.generate(prompt=PROMPT, sampling_params={"max_new_tokens": 3})
        assert out["meta_info"]["weight_version"] == "remote-1"

        # A bad shape: the server refuses with 400 and the sender names the target.
        bad = {"model.norm.weight": torch.zeros(3)}
        with pytest.raises(WeightSyncError, match="RemoteEngine"):
            sender.send(bad, [remote], weight_version="remote-bad")
        assert remote.get_weight_version() == "remote-1"
    finally:
        sender.close([remote])
    assert not remote.destroy_weights_update_group()["success"]  # already gone


def test_staging_travels_to_the_server(engine, remote, tmp_path):
    """The server stages by default; staging="none" from the client receives in place, so a
    NaN leaves it refusing generation until a complete update."""
    new = load_file(f"{write_tiny_chat_model(str(tmp_path / 'new'), seed=6)}/model.safetensors")
    bad = {**new, "model.norm.weight": new["model.norm.weight"].clone()}
    bad["model.norm.weight"][0] = float("nan")
    with pytest.raises(ValueError, match="staging"):
        remote.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]],
                                               staging="copy")
    sender = WeightSender("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=60)
    try:
        with pytest.raises(WeightSyncError, match="non-finite"):
            sender.send(bad, [remote], weight_version="nan", staging="none")
        with pytest.raises(WeightsIncompleteError):
            remote.generate(prompt=PROMPT, sampling_params={"max_new_tokens": 2})
        assert sender.send(new, [remote], weight_version="remote-2", staging="none")[0]["success"]
        out = remote.generate(prompt=PROMPT, sampling_params={"max_new_tokens": 2})
        assert out["meta_info"]["weight_version"] == "remote-2"
    finally:
        sender.close([remote])
