"""Streams: OpenAI and native SSE against the Engine, the wire format, and client disconnects."""

from __future__ import annotations

import json

import httpx
import pytest
from fixtures import API_KEY, MESSAGES, PROMPT, fresh, wait_until

from hotswap.engine import Engine, RemoteEngine


def test_completion_stream_equals_engine(api_engine, api_client):
    want = fresh(api_engine, api_engine.generate, prompt=PROMPT,
                 sampling_params={"max_new_tokens": 12, "seed": 9})
    stream = fresh(api_engine, api_client.completions.create, model="tiny", prompt=PROMPT,
                   max_tokens=12, seed=9, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want["text"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_stream_with_usage_and_n(api_engine, api_client):
    want = fresh(api_engine, api_engine.generate, messages=MESSAGES,
                 sampling_params={"max_new_tokens": 10, "seed": 4, "n": 2})
    stream = fresh(api_engine, api_client.chat.completions.create, model="tiny", messages=MESSAGES,
                   max_tokens=10, seed=4, n=2, stream=True, logprobs=True,
                   stream_options={"include_usage": True})
    texts, finishes, logprobs = ["", ""], [None, None], [0, 0]
    chunks = list(stream)
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
            logprobs[c.index] += len(c.logprobs.content) if c.logprobs else 0
    assert texts == [o["text"] for o in want]
    assert finishes == ["length", "length"]
    assert logprobs == [10, 10]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == want[0]["meta_info"]["prompt_tokens"]


def test_sse_wire_format_ends_with_done(api_user):
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
    with api_user.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    assert all("choices" in json.loads(f[6:]) for f in frames[:-1])


def test_streamed_text_with_unicode_line_separators(api_server):
    """U+2028, U+2029 and U+0085 are line ends to str.splitlines() (and httpx's aiter_lines):
    a streamed frame holding one raw would be cut in two. The `choices` grammar makes the
    random model write them."""
    text = "a\u2028b\x85c\u2029d"
    remote = RemoteEngine(api_server.url, api_key=API_KEY)
    events = list(remote.generate(prompt=PROMPT, stream=True,
                                  sampling_params={"choices": [text], "max_new_tokens": 32}))
    assert "".join(e["text"] for e in events) == text  # each event carries its new text
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "stop"


# Client disconnects

def _pool_is_whole(engine: Engine) -> bool:
    assert engine.flush_cache(timeout_s=5)["success"]
    allocator = engine.runner.allocator
    return allocator.available_size() == allocator.size


def test_stream_disconnect_aborts_and_frees_kv(api_engine, api_server, api_admin):
    body = {"prompt": PROMPT, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
            "stream": True}
    with httpx.Client(base_url=api_server.url, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c, \
            c.stream("POST", "/generate", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        # Hold the request mid-generation (it keeps its KV), then leave.
        assert api_admin.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
        assert len(api_engine.scheduler.running) == 1
    assert wait_until(lambda: not api_engine.scheduler.running and not api_engine.scheduler.waiting)
    assert api_admin.post("/continue_generation").json()["success"]
    assert api_admin.post("/debug/check_integrity").json() == {"success": True, "message": "ok"}
    assert _pool_is_whole(api_engine)


def test_queued_and_blocking_requests_abort_on_disconnect(api_engine, api_server, api_admin):
    assert api_admin.post("/pause_generation", json={"mode": "retract"}).json()["success"]
    try:
        for path, body in (
                ("/generate", {"prompt": PROMPT, "sampling_params": {"max_new_tokens": 50}}),
                ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 50}),
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": 50, "stream": True})):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{api_server.url}{path}", json=body, timeout=0.5,
                           headers={"Authorization": f"Bearer {API_KEY}"})
            assert wait_until(lambda: not api_engine.scheduler.waiting), path
    finally:
        assert api_admin.post("/continue_generation").json()["success"]
    assert api_admin.post("/debug/check_integrity").json()["success"]
    assert _pool_is_whole(api_engine)
