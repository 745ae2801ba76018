"""SGLang route compatibility (docs/api.md#sglang-compatibility); RemoteEngine's tensor updates."""

from __future__ import annotations

import httpx
import pytest
import torch
from fixtures import serve, write_tiny_chat_model

from hotswap.engine import Engine, RemoteEngine
from hotswap.weight_sync.serialize import deserialize_named_tensors, serialize_named_tensors

API_KEY, ADMIN_KEY = "user-key", "admin-key"
IDS = [5, 9, 33, 40, 7, 12]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_chat_model(str(tmp_path_factory.mktemp("sglang_compat")))
    with Engine(path, max_total_tokens=4096) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    with serve(engine, api_key=API_KEY, admin_key=ADMIN_KEY) as srv:
        yield srv


@pytest.fixture
def admin(server):
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        yield c


def test_get_routes_sglang_clients_call(admin, engine):
    assert admin.get("/flush_cache").json()["success"]
    assert admin.get("/health_generate").status_code == 200
    info = admin.get("/get_model_info").json()
    assert info["model_path"] == engine.config.model_path and info["is_generation"]
    server_info = admin.get("/get_server_info").json()
    assert server_info["weight_version"] == engine.get_weight_version()
    load = admin.get("/v1/loads").json()["loads"][0]
    assert load["max_total_num_tokens"] == 4096 and load["num_running_reqs"] == 0


def test_control_get_routes_need_the_admin_key(server):
    assert httpx.get(f"{server.url}/flush_cache").status_code == 401
    assert httpx.get(f"{server.url}/flush_cache",
                     headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401


def test_generate_takes_sglang_field_names(admin, engine):
    params = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 4, "top_k": 0,
              "no_stop_trim": True, "spaces_between_special_tokens": False}
    # Both calls start from an empty cache: a cached prompt's last token is recomputed as a
    # decode row, whose float sums run in another order than the prefill's (README: determinism).
    assert admin.get("/flush_cache").json()["success"]
    got = admin.post("/generate", json={"text": "Hello, how are you", "sampling_params": params,
                                        "return_logprob": True, "logprob_start_len": -1}).json()
    assert admin.get("/flush_cache").json()["success"]
    want = engine.generate("Hello, how are you", {"max_new_tokens": 6, "temperature": 1.0,
                                                  "seed": 4}, return_logprob=True)
    assert got["output_ids"] == want["output_ids"]
    # `text` asks in SGLang's terms: logprob entries are SGLang's [logprob, id, text] triples.
    assert [e[:2] for e in got["meta_info"]["output_token_logprobs"]] == \
        want["meta_info"]["output_token_logprobs"]
    assert all(e[2] is None for e in got["meta_info"]["output_token_logprobs"])
    texts = admin.post("/generate", json={"input_ids": IDS, "return_logprob": True,
                                          "return_text_in_logprobs": True,
                                          "sampling_params": {"max_new_tokens": 3}}).json()
    for _, tid, text in texts["meta_info"]["output_token_logprobs"]:
        assert text == engine.tokenizer.decode([tid])
    plain = admin.post("/generate", json={"input_ids": IDS, "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 3}}).json()
    assert all(len(e) == 2 for e in plain["meta_info"]["output_token_logprobs"])


@pytest.mark.parametrize("body, field", [
    ({"input_ids": IDS, "image_data": ["a.png"]}, "image_data"),
    ({"input_ids": IDS, "sampling_params": {"custom_params": {"x": 1}}}, "custom_params"),
    ({"input_ids": IDS, "bogus": 1}, "bogus"),
    ({"text": "hi", "prompt": "hi"}, "text or prompt"),
    ({"input_ids": IDS, "sampling_params": {"sampling_seed": 1, "seed": 2}}, "sampling_seed"),
])
def test_generate_refuses_what_means_something_else(admin, body, field):
    response = admin.post("/generate", json=body)
    assert response.status_code == 400 and field in response.json()["error"]["message"]


def test_update_weight_version_relabels(admin, engine):
    assert admin.post("/update_weight_version", json={"new_version": "rl-7"}).json()["success"]
    assert admin.get("/get_weight_version").json()["weight_version"] == "rl-7"
    out = admin.post("/generate", json={"input_ids": IDS,
                                        "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["weight_version"] == "rl-7"


def test_serialized_tensors_round_trip_and_refuse_pickles():
    named = {"a": torch.arange(6, dtype=torch.float32).view(2, 3),
             "b": torch.ones(2, dtype=torch.bfloat16)}
    back = dict(deserialize_named_tensors(serialize_named_tensors(named)))
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in named.items())
    import base64
    import pickle

    with pytest.raises(ValueError, match="pickled tensors"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps(named)).decode())


def test_remote_update_weights_from_tensor_buckets_then_flush(server, engine):
    remote = RemoteEngine(server.url, api_key=API_KEY, admin_key=ADMIN_KEY)
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    before_version = engine.get_weight_version()
    gen = torch.Generator().manual_seed(0)
    weights = [(n, s.view.detach() + 0.05 * torch.randn(s.view.shape, generator=gen))
               for n, s in engine.runner.weight_map.items()]
    for i in range(0, len(weights), 6):
        reply = remote.update_weights_from_tensor(weights[i:i + 6], None, False, commit=False)
        assert reply["success"] and remote.get_weight_version() == before_version
    assert remote.flush_cache()["success"]
    version = remote.get_weight_version()
    assert version != before_version
    got = remote.generate(None, greedy, IDS)
    with Engine(engine.config.model_path, max_total_tokens=1024) as reference:
        reference.update_weights_from_tensor(weights)
        assert got["output_ids"] == reference.generate(None, greedy, IDS)["output_ids"]
    assert remote.update_weights_from_tensor(weights[:1], commit=True)["success"]
    with pytest.raises(ValueError, match="serialized_named_tensors"):
        remote._post_control("/update_weights_from_tensor", serialized_named_tensors=["%%"])
