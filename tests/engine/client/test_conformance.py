"""One interface, four implementations: the same calls against an in-process Engine, a
RemoteEngine over a server, a Router over two servers, and a RayFleet of two replicas
(docs/api.md#one-interface).

Every implementation must have exactly EngineClient's methods with its signatures, give the
same outputs (greedy tokens and logprobs of a fresh engine holding the same weights), and raise
the same error types for the same bad input. The last test checks that the suite called every
method of the interface on every implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
from collections.abc import Iterator
from typing import Any

import peft
import pytest
import torch
import transformers
from fixtures import serve, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine, EngineClient, RemoteEngine
from hotswap.engine.client.protocol import HandoffClient, handoff_methods, interface_methods
from hotswap.engine.errors import WeightsIncompleteError
from hotswap.fleet import RayFleet, Router
from hotswap.weight_sync import WeightSender
from hotswap.weight_sync.group import free_port

pytestmark = pytest.mark.slow

KINDS = ("engine", "remote", "router", "ray")
# Public names an implementation may have besides the interface; anything else is drift.
EXTRAS: dict[type, set[str]] = {
    # tensors in hand: in-process only; the prefill/decode handoff (HandoffClient)
    Engine: {"get_load", "prepare_weights_from_tensor", *handoff_methods()},
    RemoteEngine: {"health", "get_metrics", *handoff_methods()},
    Router: {"choose", "done", "mark_down", "least_loaded", "members", "call_each",
             "call_each_indexed", "headers", "session_server", "servers_for"},
    RayFleet: {"members", "call_each", "call_each_indexed", "scale", "replicas_info"},
}
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "A rollout engine samples"]
ENGINE_KW = {"device": "cpu", "dtype": "float32", "max_total_tokens": 2048}
LORA_TARGETS = ["q_proj", "v_proj"]


class Recorder:
    """Passes every call through and remembers the interface methods it saw."""

    def __init__(self, client: EngineClient, called: set[str]):
        self.client, self.called = client, called

    def __getattr__(self, name: str) -> Any:
        if name in interface_methods():
            self.called.add(name)
        return getattr(self.client, name)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Any]:
    """Checkpoints A and B (same shape, other weights), a PEFT adapter over A, and what a fresh
    Engine gives for each: the reference every implementation must reproduce."""
    root = tmp_path_factory.mktemp("conformance")
    a = write_tiny_chat_model(str(root / "a"), seed=0)
    b = write_tiny_chat_model(str(root / "b"), seed=1)
    base = transformers.AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                   target_modules=LORA_TARGETS))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    adapter = str(root / "adapter")
    pm.save_pretrained(adapter)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    models = {"a": a, "b": b, "adapter": adapter, "adapter_config": adapter_config,
              "adapter_tensors": load_file(os.path.join(adapter, "adapter_model.safetensors")),
              "b_tensors": load_file(os.path.join(b, "model.safetensors"))}
    for name in ("a", "b"):
        with Engine(models[name], **ENGINE_KW) as engine:
            models[f"out_{name}"] = engine.generate(PROMPTS, GREEDY, return_logprob=True)
            if name == "a":
                engine.load_lora_adapter("ad", adapter)
                models["out_lora"] = engine.generate(PROMPTS, GREEDY, lora_name="ad")
    return models


@pytest.fixture(scope="module", params=KINDS)
def client(request, models) -> Iterator[Recorder]:
    called: set[str] = set()
    with contextlib.ExitStack() as stack:
        if request.param == "engine":
            impl = stack.enter_context(Engine(models["a"], **ENGINE_KW))
        elif request.param == "ray":
            import ray

            ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
            stack.callback(ray.shutdown)
            impl = stack.enter_context(RayFleet(models["a"], replicas=2, engine_kwargs=ENGINE_KW))
        else:
            engines = [stack.enter_context(Engine(models["a"], **ENGINE_KW))
                       for _ in range(1 if request.param == "remote" else 2)]
            urls = [stack.enter_context(serve(e)).url for e in engines]
            impl = RemoteEngine(urls[0]) if request.param == "remote" else Router(urls)
            stack.callback(impl.shutdown)
        recorder = Recorder(impl, called)
        recorder.kind = request.param
        yield recorder


def tokens(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def logprobs(outs: list[dict]) -> torch.Tensor:
    return torch.tensor([[lp for lp, _ in o["meta_info"]["output_token_logprobs"]]
                         for o in outs])


def assert_serves(client: Recorder, models: dict, name: str) -> None:
    outs = client.generate(PROMPTS, GREEDY, return_logprob=True)
    assert tokens(outs) == tokens(models[f"out_{name}"])
    torch.testing.assert_close(logprobs(outs), logprobs(models[f"out_{name}"]),
                               atol=1e-4, rtol=0)


def _shape(sig: inspect.Signature) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("impl", [Engine, RemoteEngine, Router, RayFleet], ids=KINDS)
def test_each_implementation_has_exactly_the_interface(impl):
    assert issubclass(impl, EngineClient)
    assert not impl.__abstractmethods__
    for name in interface_methods():
        want = getattr(EngineClient, name)
        have = getattr(impl, name)
        if isinstance(want, property):
            assert isinstance(have, property), name
            continue
        assert _shape(inspect.signature(have)) == _shape(inspect.signature(want)), name
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(want), name
    public = {n for n in dir(impl) if not n.startswith("_") and callable(getattr(impl, n))}
    assert public - interface_methods() == EXTRAS[impl]


@pytest.mark.parametrize("impl", [Engine, RemoteEngine], ids=["engine", "remote"])
def test_the_handoff_methods_have_one_signature(impl):
    assert issubclass(impl, HandoffClient)
    for name in handoff_methods():
        want, have = getattr(HandoffClient, name), getattr(impl, name)
        assert _shape(inspect.signature(have)) == _shape(inspect.signature(want)), name


def test_generate_positional_in_sglang_order(client, models):
    # Router.generate once took (prompt, input_ids, ...): this dict became input_ids.
    out = client.generate(PROMPTS[0], GREEDY)
    assert isinstance(out, dict)
    assert out["output_ids"] == models["out_a"][0]["output_ids"]
    ids = client.generate(None, GREEDY, [1, 5, 9, 20])
    assert len(ids["output_ids"]) == GREEDY["max_new_tokens"]


def test_generate_keywords_batch_logprobs_and_samples(client, models):
    assert_serves(client, models, "a")
    outs = client.generate(prompt=PROMPTS, sampling_params={**GREEDY, "n": 2}, rid=["g0", "g1"],
                           top_logprobs_num=2, return_logprob=True)
    assert [o["meta_info"]["id"] for o in outs] == ["g0-0", "g0-1", "g1-0", "g1-1"]
    assert tokens(outs[::2]) == tokens(models["out_a"])
    assert all(len(step) == 2 for o in outs for step in o["meta_info"]["output_top_logprobs"])
    chat = client.generate(messages=[{"role": "user", "content": "Hello"}], sampling_params=GREEDY,
                           cache_salt="s1")
    assert chat["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
    assert chat["meta_info"]["weight_version"] == client.get_weight_version()


def test_stream_and_async_give_the_same_tokens(client, models):
    events = list(client.generate(PROMPTS[0], GREEDY, stream=True))
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    streamed = [t for e in events for t in e["output_ids"]]  # each event carries the new ids
    assert streamed == models["out_a"][0]["output_ids"]

    async def run() -> tuple[list[dict], list[dict]]:
        outs = await client.async_generate(PROMPTS, GREEDY)
        stream = await client.async_generate(input_ids=[1, 5, 9], sampling_params=GREEDY,
                                             stream=True)
        return outs, [e async for e in stream]

    outs, stream = asyncio.run(run())
    assert tokens(outs) == tokens(models["out_a"])
    assert stream[-1]["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]


BAD_CALLS = {
    "two prompt kinds": lambda c: c.generate(prompt="x", input_ids=[1, 2]),
    "unknown sampling key": lambda c: c.generate("x", {"temprature": 1.0}),
    "negative max_new_tokens": lambda c: c.generate("x", {"max_new_tokens": -1}),
    "n over MAX_N": lambda c: c.generate("x", {"n": 100000}),
    "empty prompt": lambda c: c.generate(""),
    "token id out of vocabulary": lambda c: c.generate(input_ids=[1, 10**6]),
    "pause mode": lambda c: c.pause_generation("later"),
    "memory tag": lambda c: c.release_memory_occupation(["disk"]),
    "unknown weight name": lambda c: c.get_weights_by_name("model.nope.weight"),
    "tensor shape": lambda c: c.update_weights_from_tensor(
        {"model.norm.weight": torch.ones(3)}),
    "tensor name": lambda c: c.update_weights_from_tensor({"model.nope": torch.ones(3)}),
    "update pause mode": lambda c: c.update_weights_from_tensor(
        {"model.norm.weight": torch.ones(64)}, pause_mode="never"),
    "missing checkpoint": lambda c: c.update_weights_from_disk("/nonexistent/ckpt"),
    "missing adapter": lambda c: c.load_lora_adapter("x", "/nonexistent/adapter"),
    "unknown adapter": lambda c: c.unload_lora_adapter("never-loaded"),
    "unknown adapter in a request": lambda c: c.generate("x", GREEDY, lora_name="nope"),
    # the fixture model generates: scoring is a reward model's (tests/engine/models)
    "classify on a generating model": lambda c: c.classify(PROMPTS, activation=True),
    "async classify on a generating model": lambda c: asyncio.run(
        c.async_classify(input_ids=[1, 5, 9])),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_is_a_value_error_and_changes_nothing(client, models, case):
    version = client.get_weight_version()
    with pytest.raises(ValueError):
        BAD_CALLS[case](client)
    assert client.get_weight_version() == version
    assert client.generate(PROMPTS[0], GREEDY)["output_ids"] == models["out_a"][0]["output_ids"]


def test_one_call_staged_and_two_phase_updates(client, models):
    b = models["b_tensors"]
    names = sorted(b)
    half = len(names) // 2
    # Staged by SGLang's rule: flush_cache=False stages (commit=None), the last bucket commits.
    staged = client.update_weights_from_tensor({n: b[n] for n in names[:half]}, None, False)
    assert staged["success"] and client.get_weight_version() == staged["weight_version"]
    done = client.update_weights_from_tensor({n: b[n] for n in names[half:]},
                                             weight_version="b1")
    assert done["success"] and client.get_weight_version() == "b1"
    assert_serves(client, models, "b")
    values = client.get_weights_by_name("model.norm.weight", 5)
    assert values == pytest.approx(b["model.norm.weight"][:5].tolist())

    assert client.update_weights_from_disk(models["a"], weight_version="a1")["success"]
    assert_serves(client, models, "a")

    assert client.prepare_weights_from_disk(models["b"])["success"]
    assert client.abort_weight_update()["success"]
    assert client.get_weight_version() == "a1"
    assert client.prepare_weights_from_disk(models["b"])["success"]
    assert client.commit_weight_update("b2", "retract")["weight_version"] == "b2"
    assert_serves(client, models, "b")

    client.update_weights_from_disk(models["a"], commit=False)
    assert client.commit_weight_update("a2")["weight_version"] == "a2"
    client.update_weights_from_serialized(_serialized({"model.norm.weight": b[
        "model.norm.weight"]}), commit=False)
    assert client.abort_weight_update()["success"] is False  # it had written: refused
    assert client.get_weight_version() == "a2"
    assert client.update_weights_from_disk(models["a"], weight_version="a3")["success"]
    assert_serves(client, models, "a")
    assert client.update_weight_version("a3-label")["success"]
    assert client.get_weight_version() == "a3-label"


def _serialized(named: dict[str, torch.Tensor]) -> list[str]:
    from hotswap.weight_sync.serialize import serialize_named_tensors

    return [serialize_named_tensors(named)]


def test_update_over_a_process_group(client, models):
    assert client.weight_sync_ranks == {"engine": 1, "remote": 1, "router": 2,
                                       "ray": 2}[client.kind]
    sender = WeightSender("127.0.0.1", free_port(), 1 + client.weight_sync_ranks,
                          group_name="conf", backend="gloo", timeout_s=60)
    replies = sender.send(models["b_tensors"], [client], weight_version="b-dist")
    assert replies[0]["success"], replies
    assert client.get_weight_version() == "b-dist"
    assert_serves(client, models, "b")
    sender.close([client])
    assert client.update_weights_from_disk(models["a"])["success"]


def test_two_phase_over_a_process_group_with_another_engine(client, models):
    """Two targets: the sender prepares both, then commits both on one version."""
    with Engine(models["a"], **ENGINE_KW) as other:
        sender = WeightSender("127.0.0.1", free_port(), 2 + client.weight_sync_ranks,
                              group_name="conf2", backend="gloo", timeout_s=60)
        replies = sender.send(models["b_tensors"], [client, other], weight_version="b-2")
        assert [r["weight_version"] for r in replies] == ["b-2", "b-2"]
        assert_serves(client, models, "b")
        sender.close([client, other])
    assert client.update_weights_from_disk(models["a"])["success"]


def test_serving_state_controls(client, models):
    assert client.pause_generation("retract")["success"]
    assert client.continue_generation()["success"]
    assert client.flush_cache()["success"]
    client.abort_request("no-such-request")
    client.abort_request(abort_all=True)
    client.check_integrity()
    assert client.release_memory_occupation(["kv_cache"])["success"]
    assert client.resume_memory_occupation(["kv_cache"])["success"]
    assert_serves(client, models, "a")
    assert client.release_memory_occupation()["success"]
    assert client.resume_memory_occupation()["success"]
    with pytest.raises(WeightsIncompleteError):
        client.generate(PROMPTS[0], GREEDY)
    assert client.update_weights_from_disk(models["a"])["success"]
    assert_serves(client, models, "a")


def test_lora_adapters(client, models):
    assert client.list_lora_adapters() == {}
    assert client.load_lora_adapter("ad", models["adapter"])["success"]
    outs = client.generate(PROMPTS, GREEDY, lora_name="ad")
    assert tokens(outs) == tokens(models["out_lora"])
    assert client.load_lora_adapter_from_tensors("ad", models["adapter_tensors"],
                                                 models["adapter_config"],
                                                 pause_mode="abort")["success"]
    assert client.list_lora_adapters() == {"ad": 2}
    assert tokens(client.generate(PROMPTS, GREEDY, lora_name="ad")) == tokens(models["out_lora"])
    assert client.unload_lora_adapter("ad")["success"]
    assert client.list_lora_adapters() == {}


def test_sessions(client, models):
    session = client.open_session(ttl_s=60)
    first = client.generate(PROMPTS[0], GREEDY, session_id=session)
    assert first["output_ids"] == models["out_a"][0]["output_ids"]
    again = client.generate(PROMPTS[0], GREEDY, session_id=session)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0  # the replica holding the session
    with pytest.raises(ValueError, match="no such session"):
        client.generate(PROMPTS[0], GREEDY, session_id="no-such-session")
    assert client.close_session(session) is True
    assert client.close_session(session) is False
    client.check_integrity()


def test_model_name_and_requests_or_updates_naming_another_model(client, models):
    assert client.model_name == "a"  # the checkpoint folder's name
    version = client.get_weight_version()
    with pytest.raises(ValueError, match="'nope'"):
        client.update_weights_from_disk(models["b"], model="nope")
    with pytest.raises(ValueError, match="'nope'"):
        client.generate(PROMPTS[0], GREEDY, model="nope")
    assert client.get_weight_version() == version
    out = client.generate(PROMPTS[0], GREEDY, model="a")
    assert out["output_ids"] == models["out_a"][0]["output_ids"]


def test_zz_every_interface_method_was_called(client):
    assert client.called == interface_methods() - {"shutdown"}
