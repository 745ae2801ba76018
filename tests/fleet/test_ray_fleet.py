"""RayFleet on a local Ray: dispatch, one weight version for every replica, a replica killed
mid-generation, and scaling. (The interface itself is checked by the conformance suite.)"""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time

import pytest
import torch
from fixtures import wait_until, write_reward_model, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine
from hotswap.engine.client.protocol import EngineClient
from hotswap.fleet.replica import FORWARDED
from hotswap.fleet.replica_client import ReplicaClient
from hotswap.weight_sync import DeltaTracker, WeightSender, update_in_process
from hotswap.weight_sync.group import WeightSyncError, free_port

ray = pytest.importorskip("ray")
from hotswap.fleet import RayFleet  # noqa: E402

KW = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "A rollout engine samples", "Weights move every step",
           "The quick brown dog"]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=8, include_dashboard=False, configure_logging=False)  # logical CPUs
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    found = {"a": write_tiny_chat_model(str(root / "a"), seed=0),
             "b": write_tiny_chat_model(str(root / "b"), seed=1)}
    found["b_tensors"] = load_file(os.path.join(found["b"], "model.safetensors"))
    for name in ("a", "b"):
        with Engine(found[name], **KW) as engine:
            found[f"out_{name}"] = engine.generate(PROMPTS, GREEDY, return_logprob=True)
    return found


@pytest.fixture(scope="module")
def fleet(local_ray, models):
    with RayFleet(models["a"], replicas=2, engine_kwargs=KW) as f:
        yield f


def tokens(outs):
    return [o["output_ids"] for o in outs]


def a_tensors(models):
    return load_file(os.path.join(models["a"], "model.safetensors"))


def test_the_replica_client_spells_out_exactly_the_forwarded_calls():
    """One method per call a replica forwards (FORWARDED follows EngineClient), each with the
    interface's signature (Engine's for get_load), so the client cannot drift from it."""
    own = {"get", "prepare_tensors", "update_tensors"}  # the actor's own calls
    methods = {n for n in vars(ReplicaClient) if not n.startswith("_")
               and callable(getattr(ReplicaClient, n))}
    assert methods - own == FORWARDED

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for name in FORWARDED:
        want = getattr(EngineClient, name, None) or getattr(Engine, name)
        assert shape(getattr(ReplicaClient, name)) == shape(want), name


def test_two_replicas_give_one_engines_outputs_and_keep_groups_together(fleet, models):
    outs = fleet.generate(PROMPTS, GREEDY, return_logprob=True)
    assert tokens(outs) == tokens(models["out_a"])
    for got, want in zip(outs, models["out_a"], strict=True):
        torch.testing.assert_close(torch.tensor(got["meta_info"]["output_token_logprobs"])[:, 0],
                                   torch.tensor(want["meta_info"]["output_token_logprobs"])[:, 0],
                                   atol=1e-4, rtol=0)
    assert {r["state"] for r in fleet.replicas_info()} == {"serving"}
    assert len({r["pid"] for r in fleet.replicas_info()}) == 2

    # n=4 samples of one prompt, and two rows with the same prompt: one replica each.
    before = {r["index"]: r["requests"] for r in fleet.replicas_info()}
    outs = fleet.generate([PROMPTS[2], PROMPTS[2]], {**GREEDY, "n": 4})
    assert len(outs) == 8 and len({o["meta_info"]["id"] for o in outs}) == 8
    grew = {r["index"]: r["requests"] - before[r["index"]] for r in fleet.replicas_info()}
    assert sorted(grew.values()) == [0, 8]
    assert tokens(outs) == [models["out_a"][2]["output_ids"]] * 8

    # A batch spreads: with nothing cached, the least loaded replica takes the next prompt.
    before = {r["index"]: r["requests"] for r in fleet.replicas_info()}
    fleet.generate([f"{i} unrelated prompt {i}" for i in range(8)], GREEDY)
    grew = [r["requests"] - before[r["index"]] for r in fleet.replicas_info()]
    assert min(grew) >= 2, grew


def test_updates_under_load_are_one_version_per_span_on_every_replica(fleet, models):
    stop = threading.Event()
    outs: list[dict] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            while not stop.is_set():
                outs.extend(fleet.generate(PROMPTS, {"max_new_tokens": 24, "temperature": 1.0,
                                                     "ignore_eos": True}))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    versions = []
    try:
        for step in range(5):
            time.sleep(0.3)
            weights = models["b_tensors"] if step % 2 == 0 else a_tensors(models)
            reply = fleet.update_weights_from_tensor(weights, weight_version=f"s{step}")
            assert reply["success"], reply
            versions.append(fleet.get_weight_version())
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert not errors, errors
    assert versions == [f"s{i}" for i in range(5)]
    assert {r["weight_version"] for r in fleet.replicas_info()} == {"s4"}
    for out in outs:
        spans = out["meta_info"]["weight_versions"]
        assert spans and spans[0]["start"] == 0 and spans[-1]["end"] == len(out["output_ids"])
        assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
        assert {s["version"] for s in spans} <= {"0", *versions}
    # s4 holds model B's weights: the greedy outputs of a fresh engine of B.
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(models["out_b"])


def test_a_refusal_on_any_replica_leaves_every_replica_on_the_old_version(fleet, models):
    version = fleet.get_weight_version()
    serving = tokens(fleet.generate(PROMPTS, GREEDY))
    bad = dict(models["b_tensors"])
    bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("nan"))
    with pytest.raises(ValueError, match="non-finite|NaN|nan"):
        fleet.update_weights_from_tensor(bad)
    assert fleet.get_weight_version() == version

    # One replica refuses alone (its weights are released): neither commits.
    _, second = fleet.members()[1]
    second.release_memory_occupation(["weights"])
    try:
        with pytest.raises(ValueError, match="released"):
            fleet.update_weights_from_tensor(models["b_tensors"], weight_version="never")
        first = fleet.members()[0][1]
        assert first.get_weight_version() == version
        # The first replica prepared B beside its weights and dropped it: it serves as before.
        outs = ray.get(first.actor.generate.remote({"prompt": PROMPTS, "sampling_params": GREEDY}))
        assert tokens(outs) == serving
    finally:
        second.resume_memory_occupation(["weights"])
        fleet.update_weights_from_tensor(a_tensors(models), weight_version=f"{version}-again")
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(models["out_a"])


def test_weight_sender_broadcast_lands_on_every_replica_as_one_version(fleet, models):
    assert fleet.weight_sync_ranks == 2
    sender = WeightSender("127.0.0.1", free_port(), world_size=1 + fleet.weight_sync_ranks,
                          backend="gloo")
    try:
        replies = sender.send(models["b_tensors"], [fleet], weight_version="dist-b")
        assert replies[0]["success"] and fleet.get_weight_version() == "dist-b"
        assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(models["out_b"])
        sender.send(a_tensors(models), [fleet], weight_version="dist-a")
        assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(models["out_a"])
        # An inf in one tensor of the broadcast: every replica refuses it, none commits.
        bad = dict(models["b_tensors"])
        bad["model.layers.1.mlp.up_proj.weight"] = bad["model.layers.1.mlp.up_proj.weight"].clone()
        bad["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")
        with pytest.raises(WeightSyncError, match="non-finite|inf"):
            sender.send(bad, [fleet], weight_version="never")
        assert fleet.get_weight_version() == "dist-a"
        assert {r["weight_version"] for r in fleet.replicas_info()} == {"dist-a"}
        assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(models["out_a"])
    finally:
        sender.close([fleet])


def test_a_killed_replica_loses_no_request_and_its_replacement_joins_at_the_fleet_version(
        local_ray, models):
    with RayFleet(models["a"], replicas=2, engine_kwargs=KW, health_period_s=0.5) as fleet:
        fleet.update_weights_from_tensor(models["b_tensors"], weight_version="b1")
        sender = WeightSender("127.0.0.1", free_port(), world_size=3, backend="gloo")
        sender.connect([fleet])
        try:
            long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
            prompts = [f"{p} {i}" for i in range(12) for p in PROMPTS]
            result: dict = {}
            worker = threading.Thread(target=lambda: result.update(
                outs=fleet.generate(prompts, long, rid=[f"r{i}" for i in range(len(prompts))])))
            worker.start()
            # Killed as soon as it has rows: 200 tokens each are still ahead of it.
            assert wait_until(lambda: fleet.replicas_info()[0]["requests"] > 0, 30)
            victim = fleet.replicas_info()[0]
            os.kill(victim["pid"], signal.SIGKILL)
            worker.join(timeout=120)
            assert not worker.is_alive()
            outs = result["outs"]
            assert [o["meta_info"]["id"] for o in outs] == [f"r{i}" for i in range(len(prompts))]
            assert all(len(o["output_ids"]) == 200 for o in outs)
            assert any(o["meta_info"].get("resubmitted") for o in outs)
            assert all(s["version"] == "b1"
                       for o in outs for s in o["meta_info"]["weight_versions"])

            # An update while the replacement starts leaves it out and says so; the replacement
            # then copies that version before it serves.
            assert wait_until(lambda: any(r["state"] in ("starting", "joining")
                                          for r in fleet.replicas_info()), 30)
            reply = fleet.update_weights_from_tensor(models["b_tensors"], weight_version="b2")
            assert reply["success"] and "left out replica" in reply["message"], reply
            assert wait_until(
                lambda: [r["state"] for r in fleet.replicas_info()] == ["serving"] * 2, 60)
            infos = fleet.replicas_info()
            assert victim["index"] not in {r["index"] for r in infos}
            assert {r["weight_version"] for r in infos} == {"b2"}
            # The replacement serves B's weights (copied from the other replica).
            assert tokens(fleet.generate(PROMPTS * 2, GREEDY)) == tokens(models["out_b"]) * 2

            # The sender's group held the dead replica: the next send re-forms it.
            sender.send(a_tensors(models), [fleet], weight_version="a2")
            assert fleet.get_weight_version() == "a2"
            assert tokens(fleet.generate(PROMPTS * 2, GREEDY)) == tokens(models["out_a"]) * 2
        finally:  # a failure here must not leave the group registered for later tests
            sender.close([fleet])


def test_the_callers_placement_group_and_replicas_serving_http(local_ray, models):
    from ray.util.placement_group import placement_group, remove_placement_group

    from hotswap.engine import RemoteEngine

    group = placement_group([{"CPU": 1}] * 2, strategy="PACK")
    ray.get(group.ready())
    try:
        with RayFleet(models["a"], replicas=2, engine_kwargs=KW, placement_group=group,
                      http=True) as fleet:
            urls = [r["url"] for r in fleet.replicas_info()]
            assert all(u and u.startswith("http://127.0.0.1:") for u in urls)
            remote = RemoteEngine(urls[1])
            assert remote.generate(PROMPTS[0], GREEDY)["output_ids"] == tokens(
                models["out_a"])[0]
            remote.shutdown()
            with pytest.raises(ValueError, match="has 2 bundles, 0 free"):
                fleet.scale(3)
            assert [r["state"] for r in fleet.replicas_info()] == ["serving"] * 2
    finally:
        remove_placement_group(group)


def test_scale_one_to_three_to_two(local_ray, models):
    with RayFleet(models["a"], replicas=1, engine_kwargs=KW) as fleet:
        fleet.update_weights_from_tensor(models["b_tensors"], weight_version="b")
        infos = fleet.scale(3)
        assert [r["state"] for r in infos] == ["serving"] * 3
        assert {r["weight_version"] for r in infos} == {"b"}
        outs = fleet.generate([f"{p} {i}" for i in range(3) for p in PROMPTS], GREEDY)
        assert all(r["requests"] > 0 for r in fleet.replicas_info())
        assert len(outs) == 12

        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(outs=fleet.generate(
            [f"{p}!" for p in PROMPTS] * 3, {**GREEDY, "max_new_tokens": 32})))
        worker.start()
        time.sleep(0.3)
        infos = fleet.scale(2)  # the removed replica finishes its requests first
        worker.join()
        assert [r["state"] for r in infos] == ["serving"] * 2
        assert all(len(o["output_ids"]) == 32 for o in result["outs"])
        assert fleet.weight_sync_ranks == 2
        assert fleet.get_weight_version() == "b"
        assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(models["out_b"])


def test_a_stream_whose_replica_dies_restarts_its_samples_elsewhere(local_ray, models):
    with RayFleet(models["a"], replicas=2, engine_kwargs=KW, health_period_s=0.5) as fleet:
        long = {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}
        prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
        events = fleet.generate(prompts, long, stream=True)
        first = next(events)
        victim = next(r for r in fleet.replicas_info() if r["requests"] > 0)
        os.kill(victim["pid"], signal.SIGKILL)
        got: dict[str, list[int]] = {first["meta_info"]["id"]: list(first["output_ids"])}
        finished = set()
        restarted = 0
        for event in events:
            sample = event["meta_info"]["id"]
            if event["meta_info"].get("restarted"):
                restarted += 1
                got[sample] = []  # what it streamed before is dropped
            got.setdefault(sample, []).extend(event["output_ids"])
            if event["meta_info"]["finish_reason"] is not None:
                finished.add(sample)
        assert restarted > 0
        assert len(finished) == len(prompts) and all(len(v) == 150 for v in got.values())
        with Engine(models["a"], **KW) as engine:
            want = engine.generate(prompts, long)
        assert sorted(got.values()) == sorted(o["output_ids"] for o in want)


def test_routed_experts_come_back_from_the_replicas_as_from_one_engine(local_ray, tmp_path):
    """An MoE fleet with return_routed_experts: the arrays of an in-process engine, per sample,
    in input order, streamed (final event) too."""
    import numpy as np
    from fixtures import write_moe

    path = write_moe(str(tmp_path / "moe"), "mixtral", seed=0)
    kwargs = {**KW, "enable_return_routed_experts": True}
    prompts = [[5, 6, 7, 8, 9], [40, 41, 5, 6], [5, 6, 7, 30]]
    params = {**GREEDY, "n": 2}
    with Engine(path, **kwargs) as engine:
        want = engine.generate(input_ids=prompts, sampling_params=params,
                               return_routed_experts=True)
    with RayFleet(path, replicas=2, engine_kwargs=kwargs) as fleet:
        got = fleet.generate(input_ids=prompts, sampling_params=params,
                             return_routed_experts=True)
        streamed = list(fleet.generate(input_ids=prompts[0], sampling_params=GREEDY,
                                       return_routed_experts=True, stream=True))
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g["meta_info"]["routed_experts"], w["meta_info"]["routed_experts"])
    assert np.array_equal(streamed[-1]["meta_info"]["routed_experts"],
                          want[0]["meta_info"]["routed_experts"])


def test_delta_updates_reach_every_replica_as_a_full_push_would(fleet, models):
    """In-process (the object store) and over gloo: the first push is full, the next ones
    carry only the changed elements, and every replica holds the full push's values."""
    base = a_tensors(models)
    name = "model.layers.0.mlp.down_proj.weight"
    tracker = DeltaTracker(torch.float32)
    sender = WeightSender("127.0.0.1", free_port(), world_size=1 + fleet.weight_sync_ranks,
                          group_name="delta", backend="gloo")
    try:
        for step in range(3):
            named = [(n, t.clone()) for n, t in base.items()]
            dict(named)[name][step, :4] += 0.5 * (step + 1)  # a few elements change per step
            if step < 2:
                reply, pushed = update_in_process(fleet, named, tracker)
                assert reply["success"]
            else:
                sender.send(named, [fleet], delta=True)
                sender.send(named, [fleet], delta=True)  # the first is full: no base yet
                pushed = sender.last_push
            assert pushed["kind"] == ("full" if step == 0 else "delta")
            want = dict(named)[name][:4].tolist()  # rows 0-3: every changed element
            assert fleet.get_weights_by_name(name, truncate_size=4) == want
            assert tokens(fleet.generate(PROMPTS[:1], GREEDY))  # serving, on one version
    finally:
        if sender.connected:
            sender.close([fleet])
    fleet.update_weights_from_tensor(base)


def test_a_frozen_reward_model_beside_the_policy(local_ray, models, tmp_path):
    """extra_models: classify and generate go by model=; the policy's updates leave the reward
    model's version and scores as they were; an update naming it reaches it alone."""
    rm_path = str(tmp_path / "rm")
    write_reward_model(rm_path, "qwen2", 1, pad=0, seed=2)
    ids = [[5, 6, 7], [9, 8, 7, 6, 5, 4]]
    with Engine(rm_path, **KW) as engine:
        want = [o["scores"] for o in engine.classify(input_ids=ids)]
    with RayFleet(models["a"], replicas=1, engine_kwargs=KW,
                  extra_models={"rm": {"model_path": rm_path, **KW}}) as fleet:
        rm = fleet.models["rm"]
        assert fleet.model_name == "a" and set(fleet.models) == {"a", "rm"}
        assert fleet.weight_sync_ranks == 1
        scores = [o["scores"] for o in fleet.classify(input_ids=ids, model="rm")]
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(want), atol=1e-4, rtol=0)
        assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(models["out_a"])
        with pytest.raises(ValueError, match="'nope': this fleet serves a, rm"):
            fleet.generate(PROMPTS[0], GREEDY, model="nope")
        rm_version = rm.get_weight_version()

        assert fleet.update_weights_from_tensor(models["b_tensors"], weight_version="b")[
            "success"]
        assert fleet.update_weight_version("b-label")["success"]
        assert tokens(fleet.generate(PROMPTS, GREEDY, model="a")) == tokens(models["out_b"])
        assert fleet.get_weight_version() == "b-label" and rm.get_weight_version() == rm_version
        assert [o["scores"] for o in fleet.classify(input_ids=ids, model="rm")] == scores
        with pytest.raises(ValueError, match="frozen model 'rm'"):
            rm.update_weights_from_disk(rm_path)

        assert fleet.update_weights_from_disk(rm_path, weight_version="rm-2", model="rm")[
            "success"]
        assert fleet.prepare_weights_from_disk(rm_path, model="rm")["success"]
        with pytest.raises(ValueError, match="an update of model 'rm' is open"):
            fleet.update_weights_from_disk(models["a"])
        assert fleet.commit_weight_update("rm-3")["weight_version"] == "rm-3"
        assert rm.get_weight_version() == "rm-3" and fleet.get_weight_version() == "b-label"
