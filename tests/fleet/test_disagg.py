"""PDRouter (fleet/disagg.py): prompts computed on prefill engines, KV handed to decode engines.
Equal to one engine; weight updates in a loop while handoffs straddle them, with every token
checked against HF transformers under the version that produced it; a prefill engine killed
between its prefill and its transfer, a decode engine killed mid-run; the same over HTTP."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers
from fixtures import token_logprobs, wait_healthy, wait_until, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine, RemoteEngine
from hotswap.fleet import PDRouter
from hotswap.weight_sync.group import free_port

KW = {"device": "cpu", "dtype": "float32", "max_total_tokens": 8192}
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("pd")), num_hidden_layers=3,
                                 max_position_embeddings=512)


@pytest.fixture(scope="module")
def reference(model_path):
    with Engine(model_path, **KW) as engine:
        yield engine


def prompts(seed: int, count: int, lo: int = 5, hi: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 460) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def test_pair_serves_like_one_engine(model_path, reference):
    pre, dec = Engine(model_path, role="prefill", **KW), Engine(model_path, role="decode", **KW)
    pd = PDRouter([pre], [dec])
    try:
        assert pd.transport == "inline"
        ids = prompts(0, 8)
        ref = reference.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        out = pd.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
        for o, r in zip(out, ref):
            torch.testing.assert_close(token_logprobs(o), token_logprobs(r), atol=1e-5, rtol=0)
            assert o["meta_info"]["kv_handoff"]["accepted"]
        params = {**GREEDY, "temperature": 1.0, "seed": 5, "n": 4}
        ref = reference.generate(input_ids=ids[0], sampling_params=params, rid="g")
        out = pd.generate(input_ids=ids[0], sampling_params=params, rid="g")
        assert [(o["meta_info"]["id"], o["output_ids"]) for o in out] == \
            [(r["meta_info"]["id"], r["output_ids"]) for r in ref]
        streamed: dict[str, list[int]] = {}
        for event in pd.generate(input_ids=ids[0], sampling_params=params, rid="g", stream=True):
            streamed.setdefault(event["meta_info"]["id"], []).extend(event["output_ids"])
        assert streamed == {r["meta_info"]["id"]: r["output_ids"] for r in ref}
        text = "".join(e["text"] for e in pd.generate(input_ids=ids[1], sampling_params=GREEDY,
                                                      stream=True))
        assert text == reference.generate(input_ids=ids[1], sampling_params=GREEDY)["text"]
        with pytest.raises(ValueError, match="sessions"):
            pd.open_session()
        with pytest.raises(ValueError, match="max_new_tokens"):  # the engine's own message
            pd.generate(input_ids=ids[0], sampling_params={"max_new_tokens": -1})
        # one two-phase update reaches both roles
        weights = load_file(f"{model_path}/model.safetensors")
        assert pd.update_weights_from_tensor(list(weights.items()), weight_version="w")["success"]
        assert pre.get_weight_version() == dec.get_weight_version() == pd.get_weight_version()
        pd.check_integrity()
    finally:
        pd.shutdown()
        pre.shutdown()
        dec.shutdown()


class StraddlingDecoder:
    """A decode engine whose every second handoff waits for the next weight update to commit
    before it arrives: the handoffs then straddle updates for certain, not by luck."""

    def __init__(self, engine: Engine, updated: threading.Condition):
        self.engine, self.updated, self.calls = engine, updated, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate_from_handoff(self, handoff, *args, **kwargs):
        self.calls += 1
        if self.calls % 2 == 0:
            with self.updated:
                self.updated.wait(timeout=20)
        return self.engine.generate_from_handoff(handoff, *args, **kwargs)


def hf_token_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[positions, torch.tensor(output)].tolist()


def test_updates_in_a_loop_never_decode_on_kv_of_another_version(model_path):
    """Four updates through the router while long prompts are handed off. Every token is
    checked against HF's forward with the weights of the version its span names: a token
    decoded on KV of another version would be off by far more than the tolerance (the
    engine-level test shows it with the namespace check switched off)."""
    pre, dec = Engine(model_path, role="prefill", **KW), Engine(model_path, role="decode", **KW)
    updated = threading.Condition()
    pd = PDRouter([pre], [StraddlingDecoder(dec, updated)])
    base = load_file(f"{model_path}/model.safetensors")
    versions = {"0": base}
    gen = torch.Generator().manual_seed(0)
    stop = threading.Event()
    outputs = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            ids = prompts(rng.randrange(1 << 30), 1, 150, 400)[0]
            out = pd.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 24},
                              return_logprob=True)
            outputs.append((ids, out))

    try:
        with ThreadPoolExecutor(6) as pool:
            clients = [pool.submit(client, s) for s in range(6)]
            for k in range(1, 5):
                time.sleep(0.4)
                weights = {n: t + 0.05 * torch.randn(t.shape, generator=gen)
                           for n, t in base.items()}
                versions[f"v{k}"] = weights
                result = pd.update_weights_from_tensor(list(weights.items()),
                                                       weight_version=f"v{k}")
                assert result["success"], result
                with updated:
                    updated.notify_all()
            time.sleep(0.4)
            stop.set()
            with updated:
                updated.notify_all()
            for c in clients:
                c.result()
        refused = [o for _, o in outputs if not o["meta_info"]["kv_handoff"]["accepted"]]
        assert refused, "no handoff straddled an update"
        assert all("weight_version" in o["meta_info"]["kv_handoff"]["reason"] for o in refused)
        models = {}
        for version, weights in versions.items():
            model = transformers.AutoModelForCausalLM.from_pretrained(model_path,
                                                                      dtype=torch.float32)
            model.load_state_dict(weights)
            models[version] = model.eval()
        split = 0
        for ids, out in outputs:
            spans = out["meta_info"]["weight_versions"]
            split += len(spans) > 1
            got = token_logprobs(out)
            for span in spans:
                want = hf_token_logprobs(models[span["version"]], ids, out["output_ids"])
                torch.testing.assert_close(got[span["start"]: span["end"]],
                                           want[span["start"]: span["end"]], atol=1e-4, rtol=0)
        assert split >= len(refused)  # a refused handoff's first token is the old version's
        assert len(outputs) >= 12
        for engine in (pre, dec):
            engine.check_integrity()
    finally:
        stop.set()
        pd.shutdown()
        pre.shutdown()
        dec.shutdown()


def _server(model_path: str, role: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOTSWAP_API_KEY": "", "HOTSWAP_ADMIN_KEY": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hotswap.engine.server", "--model-path", model_path, "--port",
         str(port), "--role", role, "--device", "cpu", "--dtype", "float32",
         "--max-total-tokens", "8192", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy([proc], url, 120)
    return proc, url


class DiesBeforeSending:
    """A prefill server that is killed after its prefill answered, before its KV is sent."""

    def __init__(self, remote: RemoteEngine, proc: subprocess.Popen):
        self.remote, self.proc = remote, proc

    def __getattr__(self, name):
        return getattr(self.remote, name)

    def send_kv_handoff(self, handoff_id: str, dst_rank: int) -> dict:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        raise ConnectionError("the prefill engine died")


@pytest.mark.slow
def test_a_prefill_engine_dying_loses_and_repeats_nothing(model_path, reference):
    """Over the KV transfer group (gloo): the prefill server dies between its prefill and its
    send; the decode engine's receive fails, the handoff is refused, the prompt computed there.
    Then the requests sent while it is dead are prefilled by the decode engine itself."""
    proc, url = _server(model_path, "prefill")
    dec = Engine(model_path, role="decode", **KW)
    remote = RemoteEngine(url, timeout_s=60)
    pd = PDRouter([DiesBeforeSending(remote, proc)], [dec])
    try:
        port = free_port()
        assert pd.init_kv_transfer_group("127.0.0.1", port)["success"]
        ids = prompts(3, 6, 50, 200)
        ref = reference.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                                 rid=[f"r{i}" for i in range(6)])
        first = pd.generate(input_ids=ids[0], sampling_params=GREEDY, return_logprob=True,
                            rid="r0")
        handoff = first["meta_info"]["kv_handoff"]
        assert not handoff["accepted"] and "transfer" in handoff["reason"], handoff
        assert first["output_ids"] == ref[0]["output_ids"]
        assert proc.poll() is not None
        rest = pd.generate(input_ids=ids[1:], sampling_params=GREEDY, return_logprob=True,
                           rid=[f"r{i}" for i in range(1, 6)])
        outs = [first, *rest]
        assert [o["meta_info"]["id"] for o in outs] == [f"r{i}" for i in range(6)]
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
        for o, r in zip(outs, ref):
            torch.testing.assert_close(token_logprobs(o), token_logprobs(r), atol=1e-5, rtol=0)
        assert pd.stats["prefill_failures"] >= 1 and pd.stats["local_prefills"] == 5
        dec.check_integrity()
    finally:
        pd.shutdown()
        dec.shutdown()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_decode_engine_dying_resubmits_its_requests(model_path, reference):
    """Two decode servers over HTTP (KV by shm); one is killed while requests run: each of its
    requests is served again on the other, none lost, none returned twice."""
    servers = [_server(model_path, role) for role in ("prefill", "decode", "decode")]
    remotes = [RemoteEngine(url, timeout_s=60) for _, url in servers]
    pd = PDRouter([remotes[0]], remotes[1:])
    try:
        assert pd.transport == "shm"
        ids = prompts(4, 16, 50, 300)
        params = {**GREEDY, "max_new_tokens": 48}
        ref = reference.generate(input_ids=ids, sampling_params=params, return_logprob=True)
        with ThreadPoolExecutor(16) as pool:
            jobs = [pool.submit(pd.generate, input_ids=x, sampling_params=params,
                                return_logprob=True, rid=f"q{i}") for i, x in enumerate(ids)]
            assert wait_until(lambda: pd.load()["decode"][0] > 0, 60)
            servers[1][0].send_signal(signal.SIGKILL)
            outs = [j.result(timeout=120) for j in jobs]
        assert [o["meta_info"]["id"] for o in outs] == [f"q{i}" for i in range(16)]
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
        assert pd.stats["decode_failures"] >= 1
        remotes[2].check_integrity()
        leftovers = [f for f in os.listdir("/dev/shm") if f.startswith("hotswap-kv-")
                     and f.split("-")[2] == str(servers[0][0].pid)]
        assert not leftovers  # the router removed the files the dead engine never read
    finally:
        pd.shutdown()
        for proc, _ in servers:
            proc.kill()


@pytest.mark.slow
def test_a_pair_on_a_ray_cluster(model_path, reference):
    """PDRouter.on_ray on Ray's two-node test cluster (one CPU each, so one engine per node):
    the KV crosses nodes over the gloo transfer group; greedy outputs, a stream and an update
    through the router, as on one engine."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    pd = None
    try:
        pd = PDRouter.on_ray(model_path, engine_kwargs=KW, resources_per_engine={"CPU": 1})
        assert pd.transport == "group"
        nodes = {ray.get(a.info.remote())["node_id"] for a in pd._actors}
        assert len(nodes) == 2
        ids = prompts(5, 4, 20, 200)
        ref = reference.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        out = pd.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
        assert all(o["meta_info"]["kv_handoff"]["accepted"] for o in out)
        for o, r in zip(out, ref):
            torch.testing.assert_close(token_logprobs(o), token_logprobs(r), atol=1e-5, rtol=0)
        streamed = [t for e in pd.generate(input_ids=ids[0], sampling_params=GREEDY,
                                           stream=True) for t in e["output_ids"]]
        assert streamed == ref[0]["output_ids"]
        weights = load_file(f"{model_path}/model.safetensors")
        assert pd.update_weights_from_tensor(list(weights.items()), weight_version="r")["success"]
        assert pd.get_weight_version() == "r"
        out = pd.generate(input_ids=ids[1], sampling_params=GREEDY)
        assert out["output_ids"] == ref[1]["output_ids"]
        assert out["meta_info"]["weight_versions"] == [{"version": "r", "start": 0,
                                                        "end": GREEDY["max_new_tokens"]}]
    finally:
        if pd is not None:
            pd.shutdown()
        ray.shutdown()
        cluster.shutdown()


def test_pair_over_http_with_shm_and_with_the_group(model_path, reference):
    """Two servers (in threads): /prefill and /generate_from_handoff with the KV in /dev/shm,
    streamed and not; then the same over the KV transfer group joined through the admin
    routes."""
    from fixtures import serve

    pre, dec = Engine(model_path, role="prefill", **KW), Engine(model_path, role="decode", **KW)
    try:
        with serve(pre, admin_key="a") as p_srv, serve(dec, admin_key="a") as d_srv:
            remotes = [RemoteEngine(s.url, admin_key="a") for s in (p_srv, d_srv)]
            pd = PDRouter(remotes[:1], remotes[1:])
            assert pd.transport == "shm"
            ids = prompts(6, 3, 20, 200)
            ref = reference.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
            out = pd.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
            assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
            assert all(o["meta_info"]["kv_handoff"]["accepted"] for o in out)
            events = list(pd.generate(input_ids=ids[0], sampling_params=GREEDY, stream=True))
            assert [t for e in events for t in e["output_ids"]] == ref[0]["output_ids"]
            assert "".join(e["text"] for e in events) == ref[0]["text"]
            assert pd.init_kv_transfer_group("127.0.0.1", free_port())["success"]
            out = pd.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
            assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
            assert all(o["meta_info"]["kv_handoff"]["accepted"] for o in out)
            for remote in remotes:
                assert remote.destroy_kv_transfer_group()["success"]
            pd.shutdown()
    finally:
        pre.shutdown()
        dec.shutdown()
