"""Keys: the API key opens inference routes, only the admin key opens the control plane.

Refused calls change nothing; probes and scrapers need no key; an app made without keys is open.
"""

from __future__ import annotations

import httpx
import pytest
from fixtures import ADMIN_KEY, API_KEY, PROMPT, ServerThread, write_tiny_chat_model

from hotswap.engine import RemoteEngine
from hotswap.engine.server.app import create_app

CONTROL_CALLS = [
    ("/pause_generation", {"mode": "abort"}),
    ("/continue_generation", None),
    ("/flush_cache", {}),
    ("/abort_request", {"abort_all": True}),
    ("/update_weights_from_disk", {"model_path": "CKPT", "weight_version": "hacked"}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                    "rank_offset": 1, "world_size": 2}),
    ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
    ("/destroy_weights_update_group", {}),
    ("/get_weights_by_name", {"name": "model.norm.weight"}),
    ("/debug/check_integrity", None),
]


BAD_CREDENTIALS = [
    {},
    {"Authorization": "Bearer wrong-key"},
    {"Authorization": f"Bearer {API_KEY}"},  # the API key does not open the control plane
    {"Authorization": f"Basic {ADMIN_KEY}"},
    {"Authorization": ADMIN_KEY},
    {"Authorization": f"Bearer {ADMIN_KEY}x"},
]


def test_control_routes_refuse_bad_keys_and_change_nothing(api_engine, api_server, tmp_path):
    other = write_tiny_chat_model(str(tmp_path / "other"), seed=1)
    version = api_engine.get_weight_version()
    norm = api_engine.get_weights_by_name("model.norm.weight")
    remote = RemoteEngine(api_server.url, api_key=API_KEY)
    stream = remote.generate(prompt=PROMPT, stream=True,
                             sampling_params={"max_new_tokens": 40, "ignore_eos": True})
    first = next(stream)  # a request is running while the refused calls arrive
    for headers in BAD_CREDENTIALS:
        for path, body in CONTROL_CALLS:
            if body and body.get("model_path") == "CKPT":
                body = {**body, "model_path": other}
            r = httpx.post(f"{api_server.url}{path}", json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
    events = [first, *stream]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert sum(len(e["output_ids"]) for e in events) == 40
    assert not api_engine.scheduler.paused
    assert api_engine.get_weight_version() == version
    assert api_engine.get_weights_by_name("model.norm.weight") == norm
    with pytest.raises(PermissionError):
        remote.update_weights_from_disk(other)


def test_inference_routes_need_the_api_key(api_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/generate"), ("GET", "/get_weight_version")):
            r = httpx.request(method, f"{api_server.url}{path}", headers=headers,
                              json={"prompt": "x"} if method == "POST" else None)
            assert r.status_code == 401, (path, headers)
    for key in (API_KEY, ADMIN_KEY):
        r = httpx.get(f"{api_server.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
    # Probes and Prometheus scrapers carry no key (docs/api.md#keys).
    assert httpx.get(f"{api_server.url}/health").status_code == 200
    scrape = httpx.get(f"{api_server.url}/metrics")
    assert scrape.status_code == 200 and "hotswap_weight_version_info" in scrape.text


def test_create_app_without_keys_is_open(api_engine):
    with ServerThread(create_app(api_engine)) as srv:
        assert httpx.post(f"{srv.url}/flush_cache", json={}).status_code == 200
        assert httpx.get(f"{srv.url}/v1/models").status_code == 200
