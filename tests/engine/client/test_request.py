"""The generate request, defined once (engine/client/request.py): every implementation's
signature is its fields, its shape checks are the same everywhere, and a new field reaches
every method made from it without another line."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from hotswap.engine import Engine, RemoteEngine
from hotswap.engine.client.protocol import EngineClient, HandoffClient
from hotswap.engine.client.request import (
    DistributedUpdate,
    GenerateRequest,
    request_method,
)
from hotswap.engine.server.handoff_routes import FromHandoffRequest, PrefillRequest
from hotswap.engine.server.protocol import (
    GenerateBody,
    PrepareFromDistributedRequest,
    UpdateFromDistributedRequest,
)
from hotswap.fleet import PDRouter, RayFleet, Router
from hotswap.fleet.replica_client import ReplicaClient

FIELDS = [f.name for f in dataclasses.fields(GenerateRequest)]


def params(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()
            if p.name != "self"]


@pytest.mark.parametrize("impl", [Engine, RemoteEngine, Router, RayFleet, PDRouter])
def test_every_generate_takes_exactly_the_requests_fields(impl):
    for method in (impl.generate, impl.async_generate):
        got = params(method)
        assert [name for name, _, _ in got] == FIELDS
        positional = [n for n, kind, _ in got if kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert positional == ["prompt", "sampling_params", "input_ids"]  # SGLang's order
        assert {n: d for n, _, d in got} == {f.name: f.default
                                               for f in dataclasses.fields(GenerateRequest)}
    assert inspect.iscoroutinefunction(impl.async_generate)
    assert not impl.__abstractmethods__  # _generate and _async_generate are written


def test_the_handoff_calls_and_the_routes_are_the_same_fields():
    assert [n for n, _, _ in params(HandoffClient.prefill)] == [
        *[f for f in FIELDS if f not in ("stream", "session_id")], "transport"]
    assert [n for n, _, _ in params(HandoffClient.generate_from_handoff)] == [
        "handoff", *[f for f in FIELDS if f not in ("prompt", "input_ids", "messages",
                                                    "session_id")]]
    for name in ("prefill", "generate_from_handoff", "update_weights_from_distributed",
                 "prepare_weights_from_distributed"):
        owner = HandoffClient if hasattr(HandoffClient, name) else EngineClient
        assert params(getattr(ReplicaClient, name)) == params(getattr(owner, name)), name
    assert set(FIELDS) <= set(GenerateBody.model_fields)
    assert set(PrefillRequest.model_fields) == {*FIELDS, "transport"} - {"stream", "session_id"}
    assert set(FromHandoffRequest.model_fields) == {"handoff", *FIELDS} - {
        "prompt", "input_ids", "messages", "session_id"}
    update = [f.name for f in dataclasses.fields(DistributedUpdate)]
    assert list(UpdateFromDistributedRequest.model_fields) == update
    assert list(PrepareFromDistributedRequest.model_fields) == [
        n for n in update if n not in DistributedUpdate.COMMIT_FIELDS]
    assert [n for n, _, _ in params(EngineClient.update_weights_from_distributed)] == update


def test_a_new_field_reaches_the_method_and_its_implementation():
    @dataclasses.dataclass(frozen=True)
    class WithVideo(GenerateRequest):
        video_data: list | None = None

    class Client:
        generate = request_method("generate", WithVideo)

        def _generate(self, request: WithVideo) -> WithVideo:
            return request

    assert [n for n, _, _ in params(Client.generate)] == [*FIELDS, "video_data"]
    got = Client().generate("a cat", {"n": 2}, video_data=["cat.mp4"])
    assert (got.prompt, got.sampling_params, got.video_data) == ("a cat", {"n": 2}, ["cat.mp4"])
    with pytest.raises(TypeError, match="videos"):
        Client().generate("a cat", videos=["cat.mp4"])
    with pytest.raises(TypeError):
        Client().generate("a", {}, [1], "too many positional")


def test_split_gives_one_request_per_prompt_and_join_puts_them_back():
    request = GenerateRequest(prompt=["a", "b", "c"], sampling_params={"n": 2},
                              lora_name=["x", None, "y"], rid=[None, "r1", None],
                              return_logprob=True)
    rows, single = request.split()
    assert not single and [r.prompt for r in rows] == ["a", "b", "c"]
    assert [r.sampling_params for r in rows] == [{"n": 2}] * 3
    assert [r.lora_name for r in rows] == ["x", None, "y"]
    assert rows[1].rid == "r1" and len({r.rid for r in rows}) == 3  # the others generated
    assert all(r.return_logprob for r in rows)
    assert rows[0].samples == 2 and rows[0].sample_ids() == [f"{rows[0].rid}-0",
                                                             f"{rows[0].rid}-1"]
    joined = GenerateRequest.join(rows)
    assert joined.prompt == ["a", "b", "c"] and joined.lora_name == ["x", None, "y"]
    assert joined.cache_salt is None and joined.return_logprob
    assert joined.body() == {"prompt": ["a", "b", "c"], "sampling_params": [{"n": 2}] * 3,
                             "lora_name": ["x", None, "y"], "rid": [r.rid for r in rows],
                             "return_logprob": True}

    one, single = GenerateRequest(input_ids=[1, 2, 3]).split()
    assert single and one[0].input_ids == [1, 2, 3] and one[0].kind == "input_ids"
    chat = [{"role": "user", "content": "hi"}]
    rows, single = GenerateRequest(messages=[chat, chat]).split()
    assert not single and [r.messages for r in rows] == [chat, chat]
    assert GenerateRequest(prompt="x").body() == {"prompt": "x"}  # defaults stay home


@pytest.mark.parametrize("request_, message", [
    (GenerateRequest(), "exactly one of prompt, input_ids, messages"),
    (GenerateRequest(prompt="a", input_ids=[1]), "exactly one of"),
    (GenerateRequest(prompt=[]), "prompt must be a non-empty"),
    (GenerateRequest(input_ids=[1, "2"]), "input_ids must be"),
    (GenerateRequest(input_ids=[True]), "input_ids must be"),
    (GenerateRequest(messages=["hi"]), "messages must be"),
    (GenerateRequest(prompt=["a", "b"], lora_name=["x"]), "lora_name must be a str or a list "
                                                           "of 2"),
    (GenerateRequest(prompt="a", sampling_params=[{}, {}]), "sampling_params must be a dict"),
    (GenerateRequest(prompt=["a", "b"], rid=["r", "r"]), "rid values must be unique"),
    (GenerateRequest(prompt="a", top_logprobs_num=101), "top_logprobs_num must be an integer"),
    (GenerateRequest(prompt="a", top_logprobs_num=True), "top_logprobs_num must be an integer"),
    (GenerateRequest(prompt="a", return_logprob="yes"), "return_logprob must be a bool"),
])
def test_bad_shapes_are_refused_naming_the_field(request_, message):
    with pytest.raises(ValueError, match=message):
        request_.split()
