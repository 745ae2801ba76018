"""Router over two real server processes: prefix-affinity routing, pass-through routes and
streams, and weight updates that commit on both servers or on neither."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from fixtures import (
    CORPUS,
    ServerThread,
    serve,
    wait_healthy,
    write_reward_model,
    write_tiny_chat_model,
)
from safetensors.torch import load_file

from hotswap.engine import Engine, RemoteEngine
from hotswap.engine.errors import RemoteEngineError
from hotswap.engine.server.app import route_table
from hotswap.fleet import PrefixAffinity, Router
from hotswap.fleet.router_app import create_router_app
from hotswap.weight_sync import WeightSender
from hotswap.weight_sync.group import free_port
from hotswap.weight_sync.serialize import serialize_named_tensors

ADMIN = "router-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
GREEDY = {"max_new_tokens": 4, "temperature": 0.0}
PREFIX_1 = " ".join(CORPUS[:3])
PREFIX_2 = " ".join(CORPUS[3:])

pytestmark = pytest.mark.slow


def _start(args: list[str], cwd: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOTSWAP_API_KEY": "", "HOTSWAP_ADMIN_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", *args, "--port", str(port), "--admin-key",
                             ADMIN, "--log-level", "warning"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two servers of model `a`, started in different folders: the relative checkpoint path
    "ckpt" is model `b` for the first and a model of another shape for the second."""
    root = tmp_path_factory.mktemp("router")
    a = write_tiny_chat_model(str(root / "a"), seed=0)
    b = write_tiny_chat_model(str(root / "b"), seed=1)
    os.makedirs(root / "x")
    shutil.copytree(b, root / "x" / "ckpt")
    write_tiny_chat_model(str(root / "y" / "ckpt"), seed=2, intermediate_size=192)
    servers = [_start(["hotswap.engine.server", "--model-path", a, "--device", "cpu",
                       "--max-total-tokens", "4096"], str(root / d)) for d in ("x", "y")]
    urls = [u for _, u in servers]
    # The router starts beside them: its /health is healthy once both servers are.
    servers.append(_start(["hotswap.fleet", "--urls", *urls], str(root)))
    procs = [p for p, _ in servers]
    try:
        wait_healthy(procs, servers[-1][1], 150)
        router_url = servers[-1][1]
        yield {"urls": urls, "router": router_url, "a": a, "b": b}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _generate(url: str, prompt: str) -> tuple[str, dict]:
    r = httpx.post(f"{url}/generate", json={"prompt": prompt, "sampling_params": GREEDY},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.headers.get("x-hotswap-server", url), r.json()


def test_shared_prefix_requests_land_on_the_server_holding_the_prefix(cluster):
    router = cluster["router"]
    first, out = _generate(router, PREFIX_1 + " What is it?")
    second, _ = _generate(router, PREFIX_2 + " What is it?")
    assert {first, second} == set(cluster["urls"])  # no shared prefix: load-balanced
    prefix_tokens = out["meta_info"]["prompt_tokens"] - 6
    for prefix, holder in ((PREFIX_1, first), (PREFIX_2, second), (PREFIX_1, first)):
        server, out = _generate(router, prefix + " And where is the answer?")
        assert server == holder
        assert out["meta_info"]["cached_tokens"] >= prefix_tokens // 2
    # The other server never saw PREFIX_1: it would have had to compute all of it.
    _, cold = _generate(second, PREFIX_1 + " Something else entirely?")
    assert cold["meta_info"]["cached_tokens"] == 0


def test_openai_routes_and_streams_pass_through(cluster):
    router = cluster["router"]
    system = {"role": "system", "content": PREFIX_2}
    body = {"model": "a", "max_tokens": 3, "temperature": 0,
            "messages": [system, {"role": "user", "content": "Hello?"}]}
    first = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=60)
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 3
    body["messages"] = [system, {"role": "user", "content": "How are you?"}]
    with httpx.stream("POST", f"{router}/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.headers["x-hotswap-server"] == first.headers["x-hotswap-server"]
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][5:])["object"] == "chat.completion.chunk"
    models = httpx.get(f"{router}/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "a"
    bad = httpx.post(f"{router}/generate", json={"prompt": "x", "sampling_params": {"nope": 1}})
    assert bad.status_code == 400 and "nope" in bad.json()["error"]["message"]
    # Control routes need the admin key at the router as at the servers.
    assert httpx.post(f"{router}/flush_cache", json={}).status_code == 401
    flushed = httpx.post(f"{router}/flush_cache", json={}, headers=AUTH, timeout=30).json()
    assert flushed["success"] and set(flushed["servers"]) == set(cluster["urls"])


def test_a_session_sticks_to_the_server_that_opened_it(cluster):
    router = cluster["router"]
    opened = httpx.post(f"{router}/open_session", json={"ttl_s": 30}, timeout=30)
    assert opened.status_code == 200
    session = opened.json()["session_id"]
    holders = set()
    for prompt in (PREFIX_1 + " One?", PREFIX_2 + " Two?", "Three?"):  # no shared prefix
        r = httpx.post(f"{router}/generate", timeout=60, json={
            "prompt": prompt, "sampling_params": GREEDY, "session_id": session})
        assert r.status_code == 200, r.text
        holders.add(r.headers["x-hotswap-server"])
    assert len(holders) == 1
    unknown = httpx.post(f"{router}/generate", timeout=60, json={
        "prompt": "x", "sampling_params": GREEDY, "session_id": "no-such-session"})
    assert unknown.status_code == 400 and "no such session" in unknown.text
    closed = httpx.post(f"{router}/close_session", json={"session_id": session}, timeout=30)
    assert closed.status_code == 200
    again = httpx.post(f"{router}/close_session", json={"session_id": session}, timeout=30)
    assert again.status_code == 404


def test_update_refused_by_one_server_leaves_both_on_the_old_version(cluster):
    router, urls = cluster["router"], cluster["urls"]
    probe = "The quick brown fox"
    before = [_generate(u, probe)[1]["output_ids"] for u in urls]
    refused = httpx.post(f"{router}/update_weights_from_disk", json={"model_path": "ckpt"},
                         headers=AUTH, timeout=60)
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert urls[1] in message and "no member committed" in message and urls[0] not in message
    for url, want in zip(urls, before):
        assert httpx.get(f"{url}/get_weight_version").json()["weight_version"] == "0"
        assert _generate(url, probe)[1]["output_ids"] == want  # x prepared it, then aborted

    done = httpx.post(f"{router}/update_weights_from_disk", json={"model_path": cluster["b"]},
                      headers=AUTH, timeout=60).json()
    assert done["success"] and done["weight_version"] == "1"
    assert httpx.get(f"{router}/get_weight_version").json() == {"weight_version": "1"}
    with Engine(cluster["b"], device="cpu", max_total_tokens=1024) as fresh:
        want = fresh.generate(prompt=probe, sampling_params=GREEDY)["output_ids"]
    for url in urls:
        got = _generate(url, probe)[1]
        assert got["output_ids"] == want and got["meta_info"]["weight_version"] == "1"


def test_weight_sender_through_a_router_updates_every_server(cluster):
    tensors = load_file(f"{cluster['a']}/model.safetensors")
    with Router(cluster["urls"], admin_key=ADMIN) as router:
        sender = WeightSender("127.0.0.1", free_port(), world_size=3, backend="gloo",
                              timeout_s=60)
        try:
            reply = sender.send(tensors, [router], weight_version="back-to-a")[0]
        finally:
            sender.close([router])
        assert reply["success"], reply
        assert router.get_weight_version() == "back-to-a"
        for engine in router.engines:
            got = engine.get_weights_by_name("model.embed_tokens.weight", truncate_size=4)
            assert got == tensors["model.embed_tokens.weight"][:4].tolist()
        out = router.generate(prompt="Hello", sampling_params=GREEDY)
        assert out["meta_info"]["weight_version"] == "back-to-a"
    with RemoteEngine(cluster["router"]) as front:  # RemoteEngine speaks to a router too
        assert front.get_weight_version() == "back-to-a"


def test_every_server_route_is_served_by_the_router_app(cluster):
    """The router app is built from the server's route table: no server route is a 404 or 405
    through it (a probe body with an unknown field is refused with 400 where a body is read)."""
    router = cluster["router"]
    for method, path, _ in route_table():
        r = httpx.request(method, f"{router}{path}", json={"probe_field": 1}, headers=AUTH,
                          timeout=60)
        assert r.status_code not in (404, 405), (method, path, r.status_code, r.text)


def test_control_routes_reach_every_server(cluster):
    router, urls = cluster["router"], cluster["urls"]
    servers = [RemoteEngine(u, admin_key=ADMIN) for u in urls]
    flushed = httpx.get(f"{router}/flush_cache", headers=AUTH, timeout=30)
    assert flushed.status_code == 200 and set(flushed.json()["servers"]) == set(urls)

    norm = torch.linspace(0.5, 1.5, 64)
    body = {"serialized_named_tensors": [serialize_named_tensors({"model.norm.weight": norm})],
            "weight_version": "norm-1"}
    done = httpx.post(f"{router}/update_weights_from_tensor", json=body, headers=AUTH,
                      timeout=60).json()
    assert done["success"] and done["weight_version"] == "norm-1", done
    for server in servers:
        assert server.get_weight_version() == "norm-1"
        assert server.get_weights_by_name("model.norm.weight", 3) == pytest.approx(
            norm[:3].tolist())

    # SGLang's bucketed form: flush_cache=False stages on every server, commit names one version.
    staged = {**body, "flush_cache": False, "weight_version": None}
    assert httpx.post(f"{router}/update_weights_from_tensor", json=staged, headers=AUTH,
                      timeout=60).json()["success"]
    committed = httpx.post(f"{router}/commit_weight_update", json={"weight_version": "norm-2"},
                           headers=AUTH, timeout=60).json()
    assert committed["success"] and [s.get_weight_version() for s in servers] == ["norm-2"] * 2

    assert httpx.post(f"{router}/update_weights_from_tensor", json=staged, headers=AUTH,
                      timeout=60).json()["success"]
    aborted = httpx.post(f"{router}/abort_weight_update", headers=AUTH, timeout=60).json()
    # The pieces had been written on both servers: the abort says so for each of them.
    assert not aborted["success"] and all(url in aborted["message"] for url in urls), aborted
    assert [s.get_weight_version() for s in servers] == ["norm-2"] * 2
    # The aborted stage had written into both servers: both refuse until a complete update.
    for url in urls:
        assert httpx.get(f"{url}/health").status_code == 503
    restored = httpx.post(f"{router}/update_weights_from_disk", json={"model_path": cluster["a"]},
                          headers=AUTH, timeout=60).json()
    assert restored["success"]
    assert all(httpx.get(f"{url}/health").status_code == 200 for url in urls)


def test_affinity_tree_matches_forgets_and_bounds_memory():
    tree = PrefixAffinity(max_items=40)
    tree.insert("hello world", 0)
    tree.insert("hello there", 1)
    tree.insert((1, 2, 3, 4), 1)
    assert tree.match("hello world!") == {0: 11, 1: 6}
    assert tree.match("help") == {0: 3, 1: 3}
    assert tree.match((1, 2, 9)) == {1: 2}
    tree.insert("another key that is long", 0)  # 24 more items: the oldest keys go
    assert tree.match("hello world") == {1: 6}
    tree.forget_server(1)
    assert tree.match("hello there") == {} and tree.match("another") == {0: 7}


def test_router_refuses_bad_arguments():
    with pytest.raises(ValueError, match="urls"):
        Router([])
    with pytest.raises(ValueError, match="repeats"):
        Router(["http://a", "http://a/"])
    with pytest.raises(ValueError, match="cache_threshold"):
        Router(["http://a"], cache_threshold=2)


def _reward_model(path: str) -> str:
    write_reward_model(path, "qwen2", 1, pad=0, seed=2)
    return path


@pytest.fixture(scope="module")
def policy_and_rm(tmp_path_factory):
    """A Router over a policy server and a frozen reward model's server ("rm"), in-process,
    with the Router's HTTP front."""
    root = tmp_path_factory.mktemp("models")
    paths = {"policy": write_tiny_chat_model(str(root / "policy"), seed=0),
             "b": write_tiny_chat_model(str(root / "b"), seed=1),
             "rm": _reward_model(str(root / "rm"))}
    kw = {"device": "cpu", "dtype": "float32", "max_total_tokens": 2048}
    with contextlib.ExitStack() as stack:
        policy = stack.enter_context(Engine(paths["policy"], **kw))
        rm = stack.enter_context(Engine(paths["rm"], served_model_name="rm", frozen=True, **kw))
        urls = [stack.enter_context(serve(e)).url for e in (policy, rm)]
        router = stack.enter_context(Router(urls))
        front = stack.enter_context(ServerThread(create_router_app(router)))
        yield {"policy": policy, "rm": rm, "urls": urls, "router": router, "front": front.url,
               "paths": paths, "kw": kw}


def test_requests_go_to_the_servers_of_the_model_they_name(policy_and_rm):
    s = policy_and_rm
    router, ids = s["router"], [[5, 6, 7], [9, 8, 7, 6, 5, 4]]
    assert router.served_models == {"policy": {"frozen": False, "servers": [0]},
                                     "rm": {"frozen": True, "servers": [1]}}
    assert router.model_name == "policy"
    assert router.weight_sync_ranks == 1  # a trainer's group holds the policy only
    scores = router.classify(input_ids=ids, model="rm")
    assert [o["scores"] for o in scores] == [o["scores"] for o in s["rm"].classify(input_ids=ids)]
    want = s["policy"].generate(input_ids=ids[0], sampling_params=GREEDY)["output_ids"]
    assert router.generate(input_ids=ids[0], sampling_params=GREEDY)["output_ids"] == want
    with pytest.raises(ValueError, match="classify needs a reward model"):
        router.classify(input_ids=ids)  # no model: the policy's
    with pytest.raises(ValueError, match="'nope': no server serves it"):
        router.generate(input_ids=ids[0], sampling_params=GREEDY, model="nope")

    front = s["front"]
    r = httpx.post(f"{front}/classify_native", json={"input_ids": ids[0], "model": "rm"})
    assert r.status_code == 200 and r.headers["x-hotswap-server"] == s["urls"][1]
    assert r.json()["scores"] == scores[0]["scores"]
    assert httpx.post(f"{front}/classify_native", json={"input_ids": ids[0]}).status_code == 400
    for path in ("/classify", "/v1/classify", "/v1/embeddings"):  # vLLM's bodies, by "model"
        r = httpx.post(f"{front}{path}", json={"model": "rm", "input": "Hello"})
        assert r.headers["x-hotswap-server"] == s["urls"][1], path
    r = httpx.post(f"{front}/generate", json={"input_ids": ids[0], "sampling_params": GREEDY})
    assert r.headers["x-hotswap-server"] == s["urls"][0] and r.json()["output_ids"] == want
    for model in ("policy", "policy:adapter", "gpt-x"):  # OpenAI's names: the policy's
        r = httpx.post(f"{front}/v1/completions", json={"model": model, "prompt": "Hello",
                                                        "max_tokens": 2})
        assert r.headers["x-hotswap-server"] == s["urls"][0], model
    assert [m["id"] for m in httpx.get(f"{front}/v1/models").json()["data"]] == ["policy", "rm"]
    info = httpx.get(f"{front}/get_server_info").json()
    assert info["served_model_name"] == "policy" and info["models"]["rm"]["frozen"] is True


def test_a_policy_update_never_reaches_the_frozen_reward_model(policy_and_rm):
    s = policy_and_rm
    router, rm, ids = s["router"], s["rm"], [[5, 6, 7], [9, 8, 7, 6]]
    rm_version, scores = rm.get_weight_version(), rm.classify(input_ids=ids)
    assert router.update_weights_from_disk(s["paths"]["b"], weight_version="b")["success"]
    assert router.update_weight_version("b-label")["success"]
    b = load_file(os.path.join(s["paths"]["b"], "model.safetensors"))
    assert router.update_weights_from_tensor(b, weight_version="b2")["success"]
    assert s["policy"].get_weight_version() == router.get_weight_version() == "b2"
    assert rm.get_weight_version() == rm_version
    after = router.classify(input_ids=ids, model="rm")
    assert [o["scores"] for o in after] == [o["scores"] for o in scores]
    assert {o["meta_info"]["weight_version"] for o in after} == {rm_version}
    r = httpx.post(f"{s['front']}/update_weight_version", json={"new_version": "b3"},
                   headers=AUTH if router.admin_key else {})
    assert r.status_code == 200 and rm.get_weight_version() == rm_version

    # Named, an update reaches the reward model only (two phases through the Router).
    assert router.prepare_weights_from_disk(s["paths"]["rm"], model="rm")["success"]
    assert router.commit_weight_update("rm-2")["weight_version"] == "rm-2"
    assert rm.get_weight_version() == "rm-2" and router.get_weight_version() == "b3"
    with pytest.raises(ValueError, match="for model 'rm'; this engine serves 'policy'"):
        s["policy"].update_weights_from_disk(s["paths"]["b"], model="rm")


def test_several_models_that_are_not_frozen_must_be_named(policy_and_rm):
    s = policy_and_rm
    with Engine(s["paths"]["b"], **s["kw"]) as other, serve(other) as server, Router(
            [s["urls"][0], server.url, s["urls"][1]]) as router:
        with pytest.raises(ValueError, match=r"several models that are not frozen \(b, policy\)"):
            router.generate(input_ids=[5, 6], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="several models"):
            router.get_weight_version()
        out = router.generate(input_ids=[5, 6], sampling_params=GREEDY, model="b")
        assert out["output_ids"] == other.generate(input_ids=[5, 6],
                                                   sampling_params=GREEDY)["output_ids"]


def test_a_server_unreachable_when_asked_its_model_is_left_out_of_requests_not_updates(
        policy_and_rm):
    s = policy_and_rm
    down = f"http://127.0.0.1:{free_port()}"
    with Router([down, s["urls"][0]]) as router:
        out = router.generate(input_ids=[5, 6], sampling_params=GREEDY)
        assert out["output_ids"] == s["policy"].generate(input_ids=[5, 6],
                                                         sampling_params=GREEDY)["output_ids"]
        version = s["policy"].get_weight_version()
        with pytest.raises(RemoteEngineError, match="unreachable"):
            router.update_weights_from_disk(s["paths"]["policy"])
        assert s["policy"].get_weight_version() == version


def test_affinity_keys_lead_with_the_prompts_images():
    """Same text with other images must not look like a shared prefix to the dispatch (the
    engine shares no KV past an image), the same images must."""
    from PIL import Image

    from hotswap.fleet.affinity import affinity_key

    red, blue = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    ids = [1, 3, 5, 4, 9, 9]

    def key(images):
        return affinity_key("/generate", {"input_ids": ids, "image_data": images})

    assert key([red]) == key([red.copy()]) and key([red]) != key([blue])
    assert key([red])[1:] == tuple(ids) and key(None) == tuple(ids)
    tree = PrefixAffinity()
    tree.insert(key([red]), 0)
    assert tree.match(key([red])) and not tree.match(key([blue]))
    # a batch is keyed by its first prompt, with that prompt's images
    assert affinity_key("/generate", {"prompt": ["x", "y"], "image_data": [[red], None]}) == \
        affinity_key("/generate", {"prompt": "x", "image_data": [red]})
    assert affinity_key("/generate", {"prompt": "x"}) == "x"
