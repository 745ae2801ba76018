"""Live weight updates end to end: an engine in this process, a trainer in another process
sending over gloo on localhost (tests/torchrun_sender.py, reached through hotswap.weight_sync.rpc),
and the engine's in-process update paths.

The reference for every update is a fresh Engine loaded from a checkpoint that holds the new
weights (for a bf16 trainer: its bf16 values cast to fp32).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from fixtures import TESTS_DIR
from safetensors.torch import load_file
from torchrun_sender import TrainerError, TrainerProcess, free_port, perturbed, save_checkpoint

from hotswap.engine import Engine
from hotswap.engine.errors import WeightsIncompleteError
from hotswap.weight_sync.rpc import RpcServer

TIMEOUT_S = 30.0
V0 = "0"  # the version a freshly loaded engine reports
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "def fibonacci(n):",
           "1, 2, 3, 4,", "Hello"]
LONG_PREFIX = ("You are a helpful assistant for a science museum. Answer every question about "
               "the exhibits accurately, kindly and briefly. ") * 8
SCRIPT = os.path.join(TESTS_DIR, "torchrun_sender.py")


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


@contextlib.contextmanager
def make_engine(path: str, **kwargs) -> Iterator[Engine]:
    kwargs = {"dtype": "float32", "max_total_tokens": 8192, "max_running_requests": 64,
              "weight_update_timeout_s": TIMEOUT_S, **kwargs}
    with Engine(path, **kwargs) as engine, watchdog(engine):
        yield engine


@contextlib.contextmanager
def watchdog(engine: Engine, seconds: float = 2 * TIMEOUT_S) -> Iterator[None]:
    """Aborts everything after `seconds`, so a stuck stream ends (and the test fails)."""
    timer = threading.Timer(seconds, lambda: engine.abort_request(abort_all=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def run(engine: Engine, prompts: list[str] = PROMPTS, n: int = 12) -> list[dict]:
    return engine.generate(prompt=prompts, sampling_params=greedy(n), return_logprob=True)


def rerun(engine: Engine) -> list[dict]:
    """run() again from an empty prefix cache: the same batches, so bit-identical outputs."""
    assert engine.flush_cache(timeout_s=TIMEOUT_S)["success"]
    return run(engine)


def logprobs(out: dict) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def assert_same_outputs(got: list[dict], expected: list[dict], tol: float = 1e-5) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert max(abs(x - y) for x, y in zip(logprobs(a), logprobs(b))) <= tol


def assert_weights_match(engine: Engine, checkpoint: str) -> None:
    """get_weights_by_name (first 100 rows) equals the checkpoint, for every tensor."""
    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    for name, tensor in tensors.items():
        got = torch.tensor(engine.get_weights_by_name(name))
        assert torch.equal(got, tensor[:100]), name


@pytest.fixture(scope="module")
def trainer() -> Iterator[TrainerProcess]:
    proc = TrainerProcess()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def v1_tensors(tiny_chat_model_path) -> dict[str, torch.Tensor]:
    return perturbed(tiny_chat_model_path, seed=1)


@pytest.fixture(scope="module")
def v1_path(tiny_chat_model_path, v1_tensors, tmp_path_factory) -> str:
    return save_checkpoint(v1_tensors, tiny_chat_model_path, str(tmp_path_factory.mktemp("v1")))


@contextlib.contextmanager
def linked(engine: Engine, trainer: TrainerProcess, bucket_bytes: int = 4 << 20,
           timeout_s: float = TIMEOUT_S) -> Iterator[None]:
    """Serves `engine` to the trainer and has the trainer's WeightSender join it."""
    with RpcServer(engine) as server:
        trainer.call("connect", address=server.address, authkey=server.authkey,
                     master_port=free_port(), bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        try:
            yield
        finally:
            trainer.call("close")


# Equivalence: a trainer process's update equals loading the new checkpoint.

def check_trainer_update(trainer: TrainerProcess, base: str, ref: str, load_format: str | None,
                         prompts: list[str], n: int, bucket_bytes: int) -> None:
    with make_engine(base) as engine:
        before = run(engine, prompts, n)
        with linked(engine, trainer, bucket_bytes):
            out = trainer.call("send", wait_s=120, key="new", weight_version="trained-1",
                               load_format=load_format)
        assert [r["success"] for r in out["replies"]] == [True]
        assert out["replies"][0]["weight_version"] == "trained-1"
        assert engine.get_weight_version() == "trained-1"
        after = run(engine, prompts, n)
        assert_weights_match(engine, ref)
        engine.check_integrity()
    with make_engine(ref) as fresh:
        assert_same_outputs(after, run(fresh, prompts, n))
    assert all(o["meta_info"]["weight_versions"] == [{"version": "trained-1", "start": 0,
                                                      "end": n}] for o in after)
    assert any(logprobs(a) != logprobs(b) for a, b in zip(after, before))  # it did change


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_process_update_equals_fresh_engine(trainer, tiny_chat_model_path, tmp_path,
                                                    load_format, dtype):
    ref = str(tmp_path / "ref")
    trainer.call("load", key="new", model_path=tiny_chat_model_path, seed=3, dtype=dtype,
                 out_dir=ref)
    check_trainer_update(trainer, tiny_chat_model_path, ref, load_format, PROMPTS, 12,
                         bucket_bytes=4 << 20)


@pytest.mark.real_model
def test_trainer_process_update_equals_fresh_engine_smollm2(trainer, real_model_path, tmp_path):
    ref = str(tmp_path / "ref")
    trainer.call("load", wait_s=120, key="new", model_path=real_model_path, seed=4,
                 scale=0.02, out_dir=ref)
    try:
        check_trainer_update(trainer, real_model_path, ref, "flattened_bucket",
                             ["What is the capital of France?", "Write a haiku about the sea."],
                             8, bucket_bytes=32 << 20)
    finally:
        trainer.call("put", key="new", tensors={})  # frees the trainer's 540 MB


# No stale KV: nothing admitted after an update reads KV of the old weights.

@pytest.mark.parametrize("salt, mode, label", [
    (None, "retract", "v1"), ("tenant-a", "retract", "v1"), (None, "in_place", "v1"),
    # New weights under the label the engine already serves (a trainer's first push "0"):
    (None, "retract", V0)])
def test_update_retires_cached_prefixes(tiny_chat_model_path, v1_tensors, v1_path, salt, mode,
                                        label):
    prompt = LONG_PREFIX + "Where are the dinosaurs?"
    with make_engine(tiny_chat_model_path) as engine:
        engine.generate(prompt=LONG_PREFIX + "Hi.", sampling_params=greedy(4), cache_salt=salt)
        warm = engine.generate(prompt=prompt, sampling_params=greedy(4), cache_salt=salt)
        assert warm["meta_info"]["cached_tokens"] > 50  # the shared prefix is cached
        holder = None
        if mode == "in_place":  # a request keeps its old-version KV through the update
            holder = engine.generate(prompt=prompt, sampling_params=greedy(400), cache_salt=salt,
                                     stream=True)
            next(holder)
        reply = engine.update_weights_from_tensor(v1_tensors, weight_version=label,
                                                  pause_mode=mode)
        assert reply["success"] and reply["weight_version"] == label
        first = engine.generate(prompt=prompt, sampling_params=greedy(10), cache_salt=salt,
                                return_logprob=True)
        second = engine.generate(prompt=prompt, sampling_params=greedy(10), cache_salt=salt,
                                 return_logprob=True)
        if holder is not None:
            events = list(holder)
            spans = events[-1]["meta_info"]["weight_versions"]
            assert [s["version"] for s in spans] == [V0, "v1"]
            assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
        engine.check_integrity()
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] > 50  # new-version KV is shared again
    assert second["output_ids"] == first["output_ids"]
    with make_engine(v1_path) as fresh:
        expected = fresh.generate(prompt=prompt, sampling_params=greedy(10), cache_salt=salt,
                                  return_logprob=True)
    assert_same_outputs([first], [expected])


# Updates under load: 32 streaming requests in flight, one update per pause mode.

LOAD_REQUESTS = 32


def load_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randint(6, 16))]
            for _ in range(LOAD_REQUESTS)]


class LoadResult:
    def __init__(self, ids: dict[str, list[int]], finals: dict[str, dict], reply: dict) -> None:
        self.ids, self.finals, self.reply = ids, finals, reply


def stream_through_update(engine: Engine, prompts: list[list[int]], max_new: int,
                          update: Callable[[], dict]) -> LoadResult:
    """Streams every prompt; once each has two tokens (none finished), runs `update`."""
    rids = [f"load-{i}" for i in range(len(prompts))]
    stream = engine.generate(input_ids=prompts, sampling_params=greedy(max_new), rid=rids,
                             stream=True)
    ids: dict[str, list[int]] = {r: [] for r in rids}
    finals: dict[str, dict] = {}
    reply = None
    for event in stream:
        meta = event["meta_info"]
        ids[meta["id"]] += event["output_ids"]
        if meta["finish_reason"] is not None:
            assert meta["id"] not in finals
            finals[meta["id"]] = meta
        if reply is None and all(len(v) >= 2 for v in ids.values()):
            assert not finals  # every request is in flight
            reply = update()
    assert reply is not None and set(finals) == set(rids)  # nothing lost
    for rid, meta in finals.items():
        assert meta["completion_tokens"] == len(ids[rid])
    return LoadResult(ids, finals, reply)


def split_at(meta: dict, new_version: str, total: int) -> int:
    """The output position where `new_version` took over; checks the spans tile [0, total)."""
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [V0, new_version]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"]
    assert spans[1]["end"] == total
    assert 2 <= spans[1]["start"] < total
    return spans[1]["start"]


@pytest.fixture(scope="module")
def v0_load_outputs(tiny_chat_model_path) -> list[list[int]]:
    with make_engine(tiny_chat_model_path) as engine:
        outs = engine.generate(input_ids=load_prompts(), sampling_params=greedy(96))
    return [o["output_ids"] for o in outs]


def test_update_under_load_abort(tiny_chat_model_path, v1_tensors, v0_load_outputs):
    with make_engine(tiny_chat_model_path) as engine:
        result = stream_through_update(
            engine, load_prompts(), 96, lambda: engine.update_weights_from_tensor(
                v1_tensors, weight_version="v1", pause_mode="abort"))
        engine.check_integrity()
    assert result.reply["success"]
    for i in range(LOAD_REQUESTS):
        ids, meta = result.ids[f"load-{i}"], result.finals[f"load-{i}"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 2 <= len(ids) < 96
        assert ids == v0_load_outputs[i][: len(ids)]
        assert meta["weight_versions"] == [{"version": V0, "start": 0, "end": len(ids)}]


def test_update_under_load_in_place(tiny_chat_model_path, v1_path, v0_load_outputs):
    with make_engine(tiny_chat_model_path) as engine:
        result = stream_through_update(
            engine, load_prompts(), 96, lambda: engine.update_weights_from_disk(
                v1_path, weight_version="v1", pause_mode="in_place"))
        engine.check_integrity()
    assert result.reply["success"]
    for i in range(LOAD_REQUESTS):
        ids, meta = result.ids[f"load-{i}"], result.finals[f"load-{i}"]
        assert meta["finish_reason"]["type"] == "length" and len(ids) == 96
        split = split_at(meta, "v1", 96)
        assert ids[:split] == v0_load_outputs[i][:split]
        assert meta["num_retractions"] == 0


def test_update_under_load_retract(trainer, tiny_chat_model_path, tmp_path):
    """Deterministic engines: a request's tokens do not depend on its batch-mates, so the
    continuation can be compared exactly with a fresh engine's."""
    ref = str(tmp_path / "ref")
    trainer.call("load", key="new", model_path=tiny_chat_model_path, seed=5, out_dir=ref)
    prompts, total = load_prompts(), 32
    with make_engine(tiny_chat_model_path, deterministic=True) as engine, \
            linked(engine, trainer):
        result = stream_through_update(engine, prompts, total, lambda: trainer.call(
            "send", key="new", weight_version="v1", pause_mode="retract"))
        engine.check_integrity()
    assert result.reply["replies"][0]["success"]
    splits = []
    for i in range(LOAD_REQUESTS):
        ids, meta = result.ids[f"load-{i}"], result.finals[f"load-{i}"]
        assert meta["finish_reason"]["type"] == "length" and len(ids) == total
        assert meta["num_retractions"] >= 1
        splits.append(split_at(meta, "v1", total))
    with make_engine(ref, deterministic=True) as fresh:
        conts = fresh.generate(
            input_ids=[p + result.ids[f"load-{i}"][:k] for i, (p, k) in enumerate(
                zip(prompts, splits))],
            sampling_params=[greedy(total - k) for k in splits])
    for i, (cont, k) in enumerate(zip(conts, splits)):
        assert result.ids[f"load-{i}"][k:] == cont["output_ids"]


# Bad updates: rejected before any write, old weights and version keep serving.

def _with(tensors: dict, name: str, tensor: torch.Tensor) -> dict:
    return {**tensors, name: tensor}


BAD_TENSORS = {
    "unknown name": (lambda t: _with(t, "model.layers.0.mlp.fc9.weight", torch.ones(4)),
                     "unexpected tensor 'model.layers.0.mlp.fc9.weight'"),
    "wrong shape": (lambda t: _with(t, "model.norm.weight", torch.ones(65)),
                    r"'model.norm.weight' has shape \(65,\), expected \(64,\)"),
    "wrong dtype": (lambda t: _with(t, "model.norm.weight", torch.ones(64, dtype=torch.int64)),
                    "'model.norm.weight' has dtype torch.int64"),
    "no data": (lambda t: _with(t, "model.norm.weight", torch.empty(64, device="meta")),
                "'model.norm.weight' holds no data"),
}


@pytest.mark.parametrize("case", [*BAD_TENSORS, "pause mode", "empty version"])
def test_bad_tensor_update_raises_and_changes_nothing(tiny_chat_model_path, v1_tensors, case):
    kwargs = {"weight_version": "bad"}
    if case in BAD_TENSORS:
        make, match = BAD_TENSORS[case]
        named = make(v1_tensors)  # every valid tensor rides along: none may be written
    else:
        named = v1_tensors
        kwargs, match = ({"pause_mode": "sideways"}, "pause_mode") if case == "pause mode" \
            else ({"weight_version": ""}, "weight_version")
    with make_engine(tiny_chat_model_path) as engine:
        before = run(engine)
        q_before = engine.get_weights_by_name("model.layers.0.self_attn.q_proj.weight")
        with pytest.raises(ValueError, match=match):
            engine.update_weights_from_tensor(named, **kwargs)
        assert engine.get_weight_version() == V0
        assert engine.get_weights_by_name("model.layers.0.self_attn.q_proj.weight") == q_before
        assert_same_outputs(rerun(engine), before, tol=0.0)
        engine.check_integrity()


def test_checkpoint_missing_a_tensor_is_rejected(tiny_chat_model_path, v1_tensors, tmp_path):
    partial = save_checkpoint(v1_tensors, tiny_chat_model_path, str(tmp_path / "partial"),
                              drop=("model.layers.1.mlp.down_proj.weight",))
    with make_engine(tiny_chat_model_path) as engine:
        before = run(engine)
        with pytest.raises(ValueError, match="missing tensor.*model.layers.1.mlp.down_proj"):
            engine.update_weights_from_disk(partial, weight_version="bad")
        assert engine.get_weight_version() == V0
        assert_same_outputs(rerun(engine), before, tol=0.0)


@pytest.mark.parametrize("case", ["unknown name", "wrong shape", "pause mode"])
def test_bad_distributed_update_fails_fast_and_group_stays_usable(
        trainer, tiny_chat_model_path, v1_tensors, v1_path, case):
    if case in BAD_TENSORS:
        trainer.call("put", key="bad", tensors=BAD_TENSORS[case][0](v1_tensors))
        kwargs = {}
    else:
        trainer.call("put", key="bad", tensors=v1_tensors)
        kwargs = {"pause_mode": "sideways"}
    trainer.call("put", key="good", tensors=v1_tensors)
    with make_engine(tiny_chat_model_path) as engine, linked(engine, trainer, timeout_s=9):
        before = run(engine)
        start = time.monotonic()
        with pytest.raises(TrainerError) as info:
            trainer.call("send", key="bad", weight_version="bad", **kwargs)
        # The engine took part in the broadcast and dropped it: no timeout on either side.
        assert time.monotonic() - start < 3
        assert info.value.kind == "WeightSyncError" and "ValueError" in str(info.value)
        assert engine.get_weight_version() == V0
        assert_same_outputs(rerun(engine), before, tol=0.0)
        out = trainer.call("send", key="good", weight_version="v1")
        assert out["replies"][0]["success"] and engine.get_weight_version() == "v1"
        after = run(engine)
    with make_engine(v1_path) as fresh:
        assert_same_outputs(after, run(fresh))


@pytest.mark.parametrize("staging", ["standby", "none"])
def test_sender_killed_mid_broadcast(tiny_chat_model_path, v1_tensors, v1_path, staging):
    """The engine errors within its timeout. Received in place, it refuses to generate on
    half-written weights until a complete update; into the standby, nothing was written and it
    serves on."""
    names = list(v1_tensors)  # the order the trainer sends in
    doomed = TrainerProcess()
    try:
        doomed.call("put", key="new", tensors=v1_tensors)
        with make_engine(tiny_chat_model_path, weight_update_timeout_s=3,
                         weight_staging=staging) as engine:
            port = free_port()
            doomed.start("partial", key="new", master_port=port, group_name="doomed",
                         count=len(names) // 2)
            engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="doomed",
                                             backend="gloo")
            victim = engine.generate(prompt="Count:", sampling_params=greedy(1000), stream=True)
            next(victim)
            result: dict = {}
            update = threading.Thread(target=lambda: result.update(
                engine.update_weights_from_distributed(
                    names, ["float32"] * len(names), [list(v1_tensors[n].shape) for n in names],
                    group_name="doomed", weight_version="v1", load_format=None)))
            update.start()
            assert doomed.result(TIMEOUT_S) == "sent"
            doomed.kill()
            killed = time.monotonic()
            update.join(TIMEOUT_S)
            assert not update.is_alive() and time.monotonic() - killed < 3 + 3
            assert result["success"] is False and result["weight_version"] == V0
            assert engine.get_weight_version() == V0
            if staging == "none":
                last = list(victim)[-1]["meta_info"]["finish_reason"]
                assert last["type"] == "abort" and "failed" in last["message"]
                with pytest.raises(WeightsIncompleteError, match="v1"):
                    engine.generate(prompt="Hello", sampling_params=greedy(2))
            else:
                assert "nothing was written" in result["message"]
                engine.abort_request(abort_all=True)
                assert list(victim)[-1]["meta_info"]["weight_version"] == V0
                assert engine.generate(prompt="Hello", sampling_params=greedy(2))["output_ids"]
            assert engine.destroy_weights_update_group("doomed")["success"]
            assert engine.update_weights_from_disk(v1_path, weight_version="v2")["success"]
            after = run(engine)
            engine.check_integrity()
    finally:
        doomed.kill()
    with make_engine(v1_path) as fresh:
        assert_same_outputs(after, run(fresh))


def test_update_that_skips_the_damaged_tensors_keeps_refusing(tiny_chat_model_path,
                                                               v1_tensors):
    """After a failed write, an update of other tensors leaves the weights mixed: still refused.
    (The third tensor has no data, so the write fails after two tensors were overwritten; the
    finite check, which would refuse it before any write, is off.)"""
    names = sorted(v1_tensors)
    broken = [(n, v1_tensors[n]) for n in names[:2]]
    broken.append((names[2], torch.empty(v1_tensors[names[2]].shape, device="meta")))
    with make_engine(tiny_chat_model_path, check_weights_finite=False) as engine:
        assert engine.update_weights_from_tensor(broken, weight_version="v1")["success"] is False
        with pytest.raises(WeightsIncompleteError):
            engine.generate(prompt="Hello", sampling_params=greedy(2))
        untouched = {names[-1]: v1_tensors[names[-1]]}
        assert engine.update_weights_from_tensor(untouched, weight_version="v2")["success"]
        with pytest.raises(WeightsIncompleteError):
            engine.generate(prompt="Hello", sampling_params=greedy(2))
        assert engine.update_weights_from_tensor(v1_tensors, weight_version="v3")["success"]
        assert engine.generate(prompt="Hello", sampling_params=greedy(2))["output_ids"]


# Soak: many updates while requests stream.

def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024


SOAK_UPDATES = 50
SOAK_RSS_BOUND_MB = 100  # the tiny model is 26 MB: one leaked copy per update would be 1.3 GB


@pytest.mark.slow
def test_soak_updates_while_streaming(trainer, tiny_chat_model_path, tmp_path):
    refs = {key: str(tmp_path / key) for key in "ab"}
    for seed, key in enumerate("ab", start=11):
        trainer.call("load", key=key, model_path=tiny_chat_model_path, seed=seed,
                     out_dir=refs[key])
    modes = ("retract", "in_place", "abort")
    finals: list[dict] = []
    errors: list[Exception] = []
    stop = threading.Event()
    with make_engine(tiny_chat_model_path, max_running_requests=8) as engine, \
            linked(engine, trainer):
        def client() -> None:
            try:
                while not stop.is_set():
                    for event in engine.generate(input_ids=load_prompts()[:4],
                                                 sampling_params=greedy(24), stream=True):
                        if event["meta_info"]["finish_reason"] is not None:
                            finals.append(event["meta_info"])
            except Exception as exc:  # noqa: BLE001 - reported by the test below
                errors.append(exc)

        thread = threading.Thread(target=client, daemon=True)
        thread.start()

        def update(i: int) -> None:
            out = trainer.call("send", key="ab"[i % 2], weight_version=f"s{i}",
                               pause_mode=modes[i % 3],
                               load_format=(None, "flattened_bucket")[i // 2 % 2])
            assert out["replies"][0]["success"]

        for i in range(-4, 0):  # warm up: transport buffers, allocator pools
            update(i)
        gc.collect()
        rss_before = rss_mb()
        for i in range(SOAK_UPDATES):
            update(i)
        gc.collect()
        growth = rss_mb() - rss_before
        stop.set()
        thread.join(TIMEOUT_S)
        assert not thread.is_alive() and not errors, errors
        assert engine.get_weight_version() == f"s{SOAK_UPDATES - 1}"
        assert_weights_match(engine, refs["ab"[(SOAK_UPDATES - 1) % 2]])
        engine.check_integrity()
    assert growth < SOAK_RSS_BOUND_MB, f"RSS grew {growth:.0f} MB over {SOAK_UPDATES} updates"
    order = {f"s{i}": i for i in range(-4, SOAK_UPDATES)} | {V0: -5}
    for meta in finals:
        reason = meta["finish_reason"]
        assert reason["type"] == "length" or "paused (mode abort)" in reason["message"]
        spans = meta["weight_versions"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == meta["completion_tokens"]
        assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
        assert [order[s["version"]] for s in spans] == sorted(order[s["version"]] for s in spans)
    assert sum(len(m["weight_versions"]) > 1 for m in finals) >= 10  # updates hit live requests


# torchrun: the trainer job's rank 0 sends while its default process group exists.

@pytest.mark.slow
def test_torchrun_rank0_sends_while_default_group_exists(tiny_chat_model_path, tmp_path):
    out_dir = str(tmp_path / "sent")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    with make_engine(tiny_chat_model_path) as engine, RpcServer(engine) as server:
        cmd = [torchrun, "--standalone", "--nproc_per_node", "2", SCRIPT,
               "--rpc-port", str(server.address[1]), "--authkey", server.authkey.hex(),
               "--model", tiny_chat_model_path, "--out", out_dir, "--version", "trained-1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        assert proc.returncode == 0, stderr[:3000] + "\n...\n" + stderr[-3000:]
        result = json.loads(stdout.strip().splitlines()[-1])
        assert result["world_size"] == 2 and result["sums"] == [3.0, 3.0]
        assert result["replies"][0]["weight_version"] == "trained-1"
        assert engine.get_weight_version() == "trained-1"
        assert_weights_match(engine, out_dir)
        after = run(engine)
    with make_engine(out_dir) as fresh:
        assert_same_outputs(after, run(fresh))


# Faults found in review: names HF's loader ignores, non-finite values, concurrent versions.

INV_FREQ = "model.layers.0.self_attn.rotary_emb.inv_freq"


def with_inv_freq(tensors: dict) -> dict:
    """What older checkpoints carry: every layer's rotary inv_freq buffer beside the weights."""
    layers = sorted({n.split(".")[2] for n in tensors if n.startswith("model.layers.")})
    return {**tensors, **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(8)
                          for i in layers}}


def test_rotary_inv_freq_alone_is_ignored_as_hf_does(tiny_chat_model_path):
    with make_engine(tiny_chat_model_path) as engine:
        before = run(engine)
        out = engine.update_weights_from_tensor([(INV_FREQ, torch.rand(8))], weight_version="v1")
        assert out["success"], out
        assert engine.get_weight_version() == "v1"
        assert_same_outputs(rerun(engine), before, tol=0.0)  # serving, and nothing changed


@pytest.mark.parametrize("path", ["tensor", "disk", "distributed", "bucket"])
def test_rotary_inv_freq_is_ignored_on_every_update_path(trainer, tiny_chat_model_path,
                                                         v1_tensors, v1_path, tmp_path, path):
    named = with_inv_freq(v1_tensors)
    with make_engine(tiny_chat_model_path) as engine:
        if path == "tensor":
            out = engine.update_weights_from_tensor(named, weight_version="v1")
        elif path == "disk":
            old = save_checkpoint(named, tiny_chat_model_path, str(tmp_path / "old"))
            out = engine.update_weights_from_disk(old, weight_version="v1")
        else:
            trainer.call("put", key="old", tensors=named)
            load_format = None if path == "distributed" else "flattened_bucket"
            with linked(engine, trainer):
                out = trainer.call("send", key="old", weight_version="v1",
                                   load_format=load_format)["replies"][0]
        assert out["success"], out
        after = run(engine)
        engine.check_integrity()
    with make_engine(v1_path) as fresh:
        assert_same_outputs(after, run(fresh))


def _poisoned(tensors: dict, value: float) -> dict:
    """`tensors` with one bad element in the tensor written last (all others would go first)."""
    last = list(tensors)[-1]
    bad = tensors[last].clone()
    bad.view(-1)[3] = value
    return {**tensors, last: bad}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("path", ["tensor", "disk"])
def test_non_finite_update_is_refused_before_any_write(tiny_chat_model_path, v1_tensors,
                                                       tmp_path, path, value):
    named = _poisoned(v1_tensors, value)
    last = list(named)[-1]
    with make_engine(tiny_chat_model_path) as engine:
        before = run(engine)
        q_before = engine.get_weights_by_name("model.layers.0.self_attn.q_proj.weight")
        with pytest.raises(ValueError, match=rf"'{re.escape(last)}'.*non-finite"):
            if path == "tensor":
                engine.update_weights_from_tensor(named, weight_version="bad")
            else:
                bad = save_checkpoint(named, tiny_chat_model_path, str(tmp_path / "bad"))
                engine.update_weights_from_disk(bad, weight_version="bad")
        assert engine.get_weight_version() == V0
        assert engine.get_weights_by_name("model.layers.0.self_attn.q_proj.weight") == q_before
        assert_same_outputs(rerun(engine), before, tol=0.0)


@pytest.mark.parametrize("staging", ["standby", "none"])
def test_nan_weights_from_a_trainer_are_never_served(trainer, tiny_chat_model_path,
                                                     v1_tensors, v1_path, staging):
    """By default the data lands in the standby and is refused before any write; received in
    place (weight_staging="none") the check comes after the write: the update fails, and
    generation is refused (not NaN) until a complete update succeeds."""
    trainer.call("put", key="nan", tensors=_poisoned(v1_tensors, float("nan")))
    trainer.call("put", key="good", tensors=v1_tensors)
    with make_engine(tiny_chat_model_path, weight_staging=staging) as engine, \
            linked(engine, trainer):
        before = run(engine)
        with pytest.raises(TrainerError, match="non-finite"):
            trainer.call("send", key="nan", weight_version="bad")
        assert engine.get_weight_version() == V0
        if staging == "none":
            with pytest.raises(WeightsIncompleteError, match="non-finite"):
                engine.generate(prompt="Hello", sampling_params=greedy(2))
        else:
            assert_same_outputs(rerun(engine), before, tol=0.0)
        assert trainer.call("send", key="good", weight_version="v1")["replies"][0]["success"]
        after = run(engine)
    with make_engine(v1_path) as fresh:
        assert_same_outputs(after, run(fresh))


def test_nan_logits_fail_the_requests_with_a_clear_error(tiny_chat_model_path, v1_tensors):
    """With the check skipped, a NaN norm weight (a diverged trainer) makes every logit NaN: the
    requests end as aborts that say why, never as tokens with NaN logprobs."""
    nan_norm = ("model.norm.weight", torch.full((64,), float("nan")))
    with make_engine(tiny_chat_model_path, check_weights_finite=False) as engine:
        assert engine.update_weights_from_tensor([nan_norm], weight_version="nan")["success"]
        outs = run(engine)
        for out in outs:
            reason = out["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and "non-finite logits" in reason["message"], out
            assert out["output_ids"] == []
        engine.check_integrity()
        assert engine.update_weights_from_tensor(v1_tensors, weight_version="v1")["success"]
        after = run(engine)
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in after)


def test_concurrent_updates_without_a_version_never_share_one(tiny_chat_model_path,
                                                              v1_tensors):
    with make_engine(tiny_chat_model_path) as engine:
        assert engine.update_weights_from_tensor(v1_tensors, weight_version="5")["success"]
        gate, holding = threading.Event(), threading.Event()

        def hold() -> None:  # the scheduler thread waits here: both updates queue up behind it
            holding.set()
            gate.wait()

        threading.Thread(target=engine.scheduler.run, args=(hold,), daemon=True).start()
        assert holding.wait(TIMEOUT_S)
        results: list[dict] = []
        threads = [threading.Thread(target=lambda: results.append(
            engine.update_weights_from_tensor(v1_tensors))) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + TIMEOUT_S
        while engine.scheduler._inbox.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        for t in threads:
            t.join(TIMEOUT_S)
        assert sorted(r["weight_version"] for r in results) == ["6", "7"]
        assert engine.get_weight_version() == "7"
