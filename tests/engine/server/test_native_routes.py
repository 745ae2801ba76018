"""The native routes: /generate against the Engine, models/health/metrics, and control routes."""

from __future__ import annotations

import os

import httpx
import pytest
from fixtures import ADMIN_KEY, API_KEY, PROMPT, fresh, token_logprobs, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import RemoteEngine


def test_native_generate_equals_engine(api_engine, api_server):
    remote = RemoteEngine(api_server.url, api_key=API_KEY)
    params = {"max_new_tokens": 9, "seed": 21}
    want = fresh(api_engine, api_engine.generate, prompt=PROMPT, sampling_params=params,
                 return_logprob=True)
    got = fresh(api_engine, remote.generate, prompt=PROMPT, sampling_params=params,
                return_logprob=True)
    assert got["output_ids"] == want["output_ids"]
    assert got["text"] == want["text"]
    assert token_logprobs(got) == pytest.approx(token_logprobs(want))
    events = list(fresh(api_engine, remote.generate, prompt=PROMPT, sampling_params=params,
                        stream=True))
    assert [t for e in events for t in e["output_ids"]] == want["output_ids"]
    assert "".join(e["text"] for e in events) == want["text"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert events[-1]["meta_info"]["weight_version"] == api_engine.get_weight_version()


def test_models_health_version_metrics(api_engine, api_user, api_server):
    models = api_user.get("/v1/models").json()
    assert models["data"][0]["id"] == os.path.basename(api_engine.config.model_path)
    assert httpx.get(f"{api_server.url}/health").json()["status"] == "ok"
    assert api_user.get("/get_weight_version").json() == {
        "weight_version": api_engine.get_weight_version()}
    text = api_user.get("/metrics").text
    for name in ("hotswap_http_requests_total", "hotswap_generated_tokens_total",
                 "hotswap_num_running_requests", "hotswap_num_waiting_requests",
                 "hotswap_cache_hit_rate", "hotswap_kv_usage", "hotswap_weight_version_info"):
        assert name in text
    assert f'hotswap_weight_version_info{{version="{api_engine.get_weight_version()}"}} 1.0' in text


def test_control_routes_work_with_admin_key(api_engine, api_server, tmp_path):
    other = write_tiny_chat_model(str(tmp_path / "other"), seed=1)
    remote = RemoteEngine(api_server.url, admin_key=ADMIN_KEY)
    assert remote.pause_generation("in_place")["success"]
    assert api_engine.scheduler.paused
    assert remote.continue_generation()["success"]
    assert not api_engine.scheduler.paused
    assert remote.flush_cache(timeout_s=5)["success"]
    remote.check_integrity()
    result = remote.update_weights_from_disk(other, weight_version="disk-1")
    assert result == {"success": True, "message": "updated to version 'disk-1'",
                      "weight_version": "disk-1"}
    assert remote.get_weight_version() == "disk-1" == api_engine.get_weight_version()
    norm = load_file(f"{other}/model.safetensors")["model.norm.weight"]
    assert remote.get_weights_by_name("model.norm.weight", 8) == pytest.approx(
        norm[:8].tolist())
    assert remote.generate(prompt=PROMPT, sampling_params={"max_new_tokens": 2})[
        "meta_info"]["weight_version"] == "disk-1"
    assert not remote.destroy_weights_update_group()["success"]  # no group: says so, no error
