"""TokenClient, SingleTurn and collect against a live tiny engine (and a RemoteEngine)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from fixtures import serve, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine, RemoteEngine
from hotswap.rollout import SingleTurn, TokenClient, collect, group_reward, nonzero_std

MESSAGES = [{"role": "user", "content": "Hello, how are you today?"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("rollout-chat")))


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, device="cpu", max_total_tokens=8192) as eng:
        yield eng


def test_single_turn_group_is_one_request_with_shared_prefill(engine):
    client = TokenClient(engine, sampling={"temperature": 1.0, "max_new_tokens": 12})
    trajs = SingleTurn().run_group(client, {"messages": MESSAGES}, 4, group_id=7, seed=3)
    prompt = client.encode_row({"messages": MESSAGES})
    assert client.stats["requests"] == 1
    assert client.stats["cached_tokens"] >= 3 * len(prompt)  # samples 1..3 reuse the prefill
    assert [t.sample_idx for t in trajs] == [0, 1, 2, 3] and {t.group_id for t in trajs} == {7}
    raw = engine.generate(input_ids=prompt, return_logprob=True, sampling_params={
        "temperature": 1.0, "max_new_tokens": 12, "n": 4, "seed": 3})
    for t, out in zip(trajs, raw):
        assert t.prompt_ids == prompt
        assert t.response_ids == out["output_ids"]
        assert t.logprobs == [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
        assert t.loss_mask == [1] * len(t.response_ids)
        assert t.versions == [engine.get_weight_version()] * len(t.response_ids)


def test_resubmit_after_a_pause_abort_keeps_per_token_versions(engine, model_path, tmp_path):
    v1 = {k: v * 1.5 for k, v in load_file(f"{model_path}/model.safetensors").items()}
    client = TokenClient(engine, sampling={"temperature": 0, "max_new_tokens": 150,
                                           "ignore_eos": True})
    prompt = client.encode_row({"messages": MESSAGES})
    v0_greedy = engine.generate(input_ids=prompt, sampling_params={
        "temperature": 0, "max_new_tokens": 150, "ignore_eos": True})["output_ids"]
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("out", client.generate(prompt)))
    worker.start()
    deadline = time.monotonic() + 30
    while not any(len(r.output_ids) >= 3 for r in list(engine.scheduler.running)):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    before = engine.get_weight_version()
    reply = engine.update_weights_from_tensor(list(v1.items()), weight_version="v1",
                                              pause_mode="abort")
    assert reply["success"]
    worker.join(60)
    (comp,) = box["out"]
    assert comp.resubmits == 1 and comp.finish_type == "length"
    assert len(comp.output_ids) == len(comp.logprobs) == len(comp.versions) == 150
    split = comp.versions.index("v1")
    assert 3 <= split < 150
    assert comp.versions == [before] * split + ["v1"] * (150 - split)
    assert comp.output_ids[:split] == v0_greedy[:split]  # the old tokens are kept as they were
    cont = engine.generate(input_ids=prompt + comp.output_ids[:split], sampling_params={
        "temperature": 0, "max_new_tokens": 150 - split, "ignore_eos": True})
    assert comp.output_ids[split:] == cont["output_ids"]  # continued under v1 from there


class AbortsFirst:
    """A backend whose first answer is an abort with the given reason and message, after two
    tokens; the resubmission then runs to its length."""

    def __init__(self, reason: str, message: str):
        self.finish = {"type": "abort", "matched": None, "message": message, "reason": reason}
        self.calls = 0

    def get_weight_version(self) -> str:
        return "step-3"

    def generate(self, input_ids, sampling_params, return_logprob, rid, **_) -> list[dict]:
        self.calls += 1
        count = 2 if self.calls == 1 else sampling_params["max_new_tokens"]
        finish = self.finish if self.calls == 1 else {"type": "length", "matched": None,
                                                      "message": None}
        return [{"text": "", "output_ids": [7] * count, "meta_info": {
            "finish_reason": finish, "output_token_logprobs": [[-1.0, 7]] * count,
            "weight_versions": [{"version": "step-3", "start": 0, "end": count}]}}]


@pytest.mark.parametrize("reason, message, resubmitted", [
    ("paused", "interrupted: new weights arrived", True),  # reworded: still the reason
    ("user", "aborted: generation paused (mode abort)", False),  # the old text, another reason
])
def test_resubmission_is_keyed_on_the_abort_reason_not_its_message(reason, message,
                                                                    resubmitted):
    backend = AbortsFirst(reason, message)
    (comp,) = TokenClient(backend, sampling={"max_new_tokens": 6}).generate([1, 2, 3])
    assert comp.resubmits == int(resubmitted) and backend.calls == 1 + int(resubmitted)
    assert comp.finish_type == ("length" if resubmitted else "abort")
    assert len(comp.output_ids) == len(comp.versions) == (6 if resubmitted else 2)


def test_collect_over_samples_until_target_groups_pass(engine):
    client = TokenClient(engine, sampling={"temperature": 1.0, "max_new_tokens": 6})
    rows = [{"prompt": f"Numbers {i} and", "id": i} for i in range(8)]

    @group_reward
    def only_even_rows_vary(group):  # groups of odd rows all score 1: no signal, filtered out
        if group[0].row["id"] % 2:
            return [1.0] * len(group)
        return [float(t.sample_idx % 2) for t in group]

    batch = collect(client, SingleTurn(), rows, group_size=4, reward=only_even_rows_vary,
                    filter=nonzero_std(), target_groups=3, seed=0)
    assert batch.num_groups == 3 and len(batch) == 12
    assert {batch.trajectories[i].row["id"] % 2 for i in range(12)} == {0}
    counts = batch.meta["groups"]
    assert counts["kept"] == 3 and counts["filtered"] >= 2
    assert counts["kept"] + counts["filtered"] + counts["aborted"] == counts["started"]
    assert batch.advantages == pytest.approx([-1, 1, -1, 1] * 3, abs=1e-5)
    t = batch.to_tensors(pad_id=0)
    assert t["loss_mask"].sum().item() == sum(len(r) for r in batch.response_ids)


def test_collect_aborts_the_rest_once_the_target_is_met(engine):
    client = TokenClient(engine, sampling={"temperature": 1.0, "ignore_eos": True})
    rows = [{"prompt": "Hello", "sampling": {"max_new_tokens": 2}},
            *[{"prompt": f"Long {i}", "sampling": {"max_new_tokens": 200}} for i in range(3)]]
    started = time.perf_counter()
    batch = collect(client, SingleTurn(), rows, group_size=2, reward=lambda t: 0.0,
                    target_groups=1, over_sample=3, max_concurrent_groups=1 + 3)
    assert batch.num_groups == 1 and batch.trajectories[0].row == rows[0]
    assert batch.meta["groups"] == {"started": 4, "kept": 1, "filtered": 0, "aborted": 3}
    assert time.perf_counter() - started < 20
    assert not client.inflight


def test_remote_engine_backend_matches_in_process(engine, model_path):
    with serve(engine) as server, RemoteEngine(server.url) as remote:
        local = TokenClient(engine, sampling={"temperature": 0, "max_new_tokens": 8})
        far = TokenClient(remote, sampling={"temperature": 0, "max_new_tokens": 8},
                          tokenizer=model_path)
        a = SingleTurn().run_group(local, {"messages": MESSAGES}, 2, 0)
        b = SingleTurn().run_group(far, {"messages": MESSAGES}, 2, 0)
    assert [t.response_ids for t in a] == [t.response_ids for t in b]
    assert [t.versions for t in a] == [t.versions for t in b]
    torch.testing.assert_close(torch.tensor([t.logprobs for t in a]),
                               torch.tensor([t.logprobs for t in b]))
