"""Sessions over HTTP: /open_session and /close_session, `session_id` on /generate and on chat,
through RemoteEngine and the OpenAI client; unknown ids are a 400 on generation, a 404 on close."""

from __future__ import annotations

import pytest
from fixtures import API_KEY, MESSAGES

from hotswap.engine import RemoteEngine


@pytest.fixture
def remote(api_server):
    return RemoteEngine(api_server.url, api_key=API_KEY)


def test_a_session_over_http(remote, api_user, api_client, api_engine) -> None:
    session = remote.open_session(ttl_s=30)
    assert api_engine.get_load()["sessions"] == 1
    ids = [5, 9, 13, 17, 21, 25, 29, 33]
    out = remote.generate(input_ids=ids, session_id=session,
                          sampling_params={"max_new_tokens": 6, "ignore_eos": True})
    again = remote.generate(input_ids=ids + out["output_ids"] + [40, 41], session_id=session,
                            sampling_params={"max_new_tokens": 2})
    assert again["meta_info"]["cached_tokens"] == len(ids) + 5  # all but the last sampled
    chat = api_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                              extra_body={"session_id": session})
    assert chat.choices[0].message.content is not None
    assert remote.close_session(session) and not remote.close_session(session)
    assert api_engine.get_load()["sessions"] == 0
    api_engine.check_integrity()


def test_bad_and_unknown_session_ids(remote, api_user) -> None:
    with pytest.raises(ValueError, match="no such session"):
        remote.generate(input_ids=[1, 2, 3], session_id="nope",
                        sampling_params={"max_new_tokens": 1})
    got = api_user.post("/close_session", json={"session_id": "nope"})
    assert got.status_code == 404 and "nope" in got.json()["error"]["message"]
    for body, field in (({"ttl_s": 0}, "ttl_s"), ({"session_id": ""}, "session_id"),
                        ({"ttl_s": "long"}, "ttl_s")):
        got = api_user.post("/open_session", json=body)
        assert got.status_code == 400 and field in got.json()["error"]["message"]
    got = api_user.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 2, "session_id": "nope"})
    assert got.status_code == 400 and "no such session" in got.json()["error"]["message"]
