"""Bad requests: a 400 with an error body, and the server still serves. The schema, fuzzed."""

from __future__ import annotations

import json

import httpx
import pytest
from fixtures import ADMIN_KEY, MESSAGES, PROMPT


def _long_prompt() -> list[int]:
    return [5] * 300  # longer than the tiny model's 256-token context


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "ten"}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2.5}),
    ("/v1/completions", {"prompt": PROMPT, "n": 10**6}),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -0.5}),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 50}),
    ("/v1/completions", {"prompt": PROMPT, "stop": 42}),
    ("/v1/completions", {"prompt": PROMPT, "stop": [""]}),
    ("/v1/completions", {"prompt": PROMPT, "seed": "abc"}),
    ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}),
    ("/v1/completions", {"prompt": PROMPT, "frequency_penalty": 5}),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"abc": 1}}),
    ("/v1/completions", {"prompt": PROMPT, "echo": True}),
    ("/v1/completions", {"prompt": PROMPT, "unknown_field": 1}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": [-3, 5]}),
    ("/v1/completions", {"prompt": _long_prompt()}),
    ("/v1/completions", {"max_tokens": 3}),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": 9, "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": "hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}}),
    ("/v1/completions", {"prompt": PROMPT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "a("}}}}),
    ("/generate", {"prompt": PROMPT, "sampling_params": {"regex": "[a-"}}),
    ("/generate", {"prompt": PROMPT, "sampling_params": {"ebnf": "root ::= ("}}),
    ("/generate", {"prompt": PROMPT, "sampling_params": {"regex": "a", "choices": ["a"]}}),
    ("/generate", {"prompt": PROMPT, "sampling_params": {"max_new_tokens": -5}}),
    ("/generate", {"prompt": PROMPT, "sampling_params": {"bogus": 1}}),
    ("/generate", {"prompt": PROMPT, "input_ids": [1, 2]}),
    ("/generate", {"input_ids": [10**9]}),
    ("/generate", {"prompt": PROMPT, "top_logprobs_num": -1}),
    ("/generate", {"messages": [{"role": "user", "content": "hi"}], "lora_name": "nope"}),
    ("/generate", {"prompt": PROMPT, "sampling_params": {"temperature": float("nan")}}),
    ("/generate", {}),
]


RAW_BAD_REQUESTS = [
    ("/v1/completions", b"not json{", "application/json"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "application/json"),
    ("/v1/chat/completions", b"[1, 2, 3]", "application/json"),
    ("/generate", b"\xff\xfe garbage", "application/json"),
    ("/generate", b'{"prompt": "x"', "application/json"),
    ("/v1/completions", b"prompt=x", "application/x-www-form-urlencoded"),
    ("/v1/completions", b'{"prompt": "' + b"x" * (2 << 20) + b'"}', "application/json"),
]


def _assert_error(r: httpx.Response, status: int = 400) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)


def _assert_still_serving(user) -> None:
    assert user.get("/health").json()["status"] == "ok"
    r = user.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path,body", BAD_REQUESTS)
def test_bad_request_is_400(api_user, path, body):
    content = json.dumps(body, allow_nan=True).encode()
    r = api_user.post(path, content=content, headers={"Content-Type": "application/json"})
    _assert_error(r)
    _assert_still_serving(api_user)


@pytest.mark.parametrize("path,content,ctype", RAW_BAD_REQUESTS)
def test_malformed_body_is_400(api_user, path, content, ctype):
    _assert_error(api_user.post(path, content=content, headers={"Content-Type": ctype}))
    _assert_still_serving(api_user)


def test_chunked_oversize_body_is_400(api_user):
    def chunks():
        for _ in range(40):
            yield b"x" * (64 << 10)

    _assert_error(api_user.post("/generate", content=chunks(),
                                headers={"Content-Type": "application/json"}))
    _assert_still_serving(api_user)


def test_bad_control_values_are_400(api_admin, api_user):
    for path, body in (("/pause_generation", {"mode": "sideways"}),
                       ("/flush_cache", {"timeout_s": -1}),
                       ("/abort_request", {}),
                       ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
                       ("/update_weights_from_distributed",
                        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}),
                       ("/get_weights_by_name", {"name": "no.such.weight"}),
                       ("/init_weights_update_group", {"master_address": "127.0.0.1",
                                                       "master_port": 0, "rank_offset": 1,
                                                       "world_size": 2})):
        _assert_error(api_admin.post(path, json=body))
    _assert_error(api_admin.get("/no/such/route"), 404)
    _assert_still_serving(api_user)


# Property-based: the OpenAPI schema, fuzzed

FUZZ_SKIP = {
    "/init_weights_update_group",  # joins a rendezvous: waits for a trainer by design
    "/init_kv_transfer_group",  # the same, for the other engines of a prefill/decode fleet
    "/pause_generation",  # would leave generation paused for the next cases
    "/release_memory_occupation",  # would leave KV or weights released for the next cases
}


def _bounded(case):
    """Keep generated work small: the ranges themselves are covered by the bad-request list."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > 8:
                body[key] = 8
        if case.path in ("/v1/chat/completions", "/v1/completions"):
            body.setdefault("max_tokens", 8)
        if isinstance(body.get("n"), int) and body["n"] > 4:
            body["n"] = 4
    return case


def _fuzz(op, mode, url: str, headers: dict, failures: list) -> None:
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=25, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode).map(_bounded))
    def run(case) -> None:
        response = case.call(base_url=url, headers=headers, timeout=60)
        if response.status_code >= 500:
            failures.append((op.label, mode.value, case.body, response.text[:300]))
        elif response.status_code >= 400:
            assert isinstance(response.json()["error"]["message"], str)

    run()


def test_openapi_fuzz_finds_no_server_error(api_server, api_engine):
    schemathesis = pytest.importorskip("schemathesis")
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    spec = httpx.get(f"{api_server.url}/openapi.json", headers=headers).json()
    operations = [r.ok() for r in schemathesis.openapi.from_dict(spec).get_all_operations()]
    assert len(operations) >= 15
    failures: list = []
    for op in operations:
        if op.path in FUZZ_SKIP:
            continue
        has_input = len(op.body) > 0 or any(True for _ in op.iter_parameters())
        for mode in schemathesis.GenerationMode:
            if has_input or mode == schemathesis.GenerationMode.POSITIVE:
                _fuzz(op, mode, api_server.url, headers, failures)
    assert failures == []
    assert httpx.get(f"{api_server.url}/health").status_code == 200
    api_engine.check_integrity()
