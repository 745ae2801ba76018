"""AsyncRollout against a tiny engine that gets a weight update after every batch."""

from __future__ import annotations

import threading

import pytest
import torch
from fixtures import write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine
from hotswap.rollout import SingleTurn, TokenClient, Trajectory
from hotswap.rollout.async_rollout import AsyncRollout
from hotswap.rollout.tracking import batch_metrics

SHORT = {"max_new_tokens": 3}
LONG = {"max_new_tokens": 120}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("async-chat")))


@pytest.fixture
def engine(model_path):
    with Engine(model_path, device="cpu", max_total_tokens=8192) as eng:
        yield eng


def push(engine: Engine, model_path: str, step: int, label: str | None = None) -> None:
    """A new version: the original weights scaled a little differently each time."""
    tensors = load_file(f"{model_path}/model.safetensors")
    scale = 1.0 + 0.05 * (step + 1)
    assert engine.update_weights_from_tensor([(k, v * scale) for k, v in tensors.items()],
                                             weight_version=label)["success"]


def adds_up(acc: dict) -> bool:
    return acc["started"] == (acc["accepted"] + acc["filtered"] + sum(acc["dropped"].values())
                              + acc["ready"] + acc["running"])


def varied(traj) -> float:
    return float(traj.sample_idx % 2)


def short_groups(engine) -> AsyncRollout:
    """Groups of 2 samples of 24 tokens, 2 groups a batch, at most 1 version stale."""
    client = TokenClient(engine, sampling={"temperature": 1.0, "ignore_eos": True,
                                           "max_new_tokens": 24})
    rows = [{"prompt": f"Numbers {i} and"} for i in range(5)]
    return AsyncRollout(client, SingleTurn(), rows, group_size=2, batch_groups=2,
                        reward=varied, max_staleness=1)


def test_staleness_bound_and_accounting_with_an_update_every_step(engine, model_path):
    runner = short_groups(engine)
    with runner:
        for step in range(4):
            batch = runner.get_batch(timeout=120)
            assert batch.meta["weight_version"] == str(step) == engine.get_weight_version()
            assert len(batch) == 4 and batch.num_groups == 2
            for versions, mask in zip(batch.weight_versions, batch.loss_mask):
                for v, m in zip(versions, mask):
                    assert m == 1 and step - int(v) <= 1  # never more than 1 behind
            assert batch.meta["staleness"]["max_lag"] <= 1
            assert adds_up(batch.meta["accounting"])
            # the gate: never more than (max_staleness + version + 1) batches admitted
            acc = batch.meta["accounting"]
            assert acc["accepted"] + acc["ready"] + acc["running"] <= (1 + step + 1) * 2
            push(engine, model_path, step)
    acc = runner.accounting()
    assert acc["accepted"] == 8 and acc["running"] == 0 and adds_up(acc)
    with pytest.raises(TimeoutError):
        short_groups(engine).get_batch(timeout=0.2)  # never started


@pytest.mark.parametrize("partial", [True, False])
def test_unfinished_groups_are_carried_or_resampled(engine, model_path, partial):
    client = TokenClient(engine, sampling={"temperature": 1.0, "ignore_eos": True})
    rows = [{"prompt": "Hello", "sampling": SHORT, "kind": "short"},
            {"prompt": "A long one", "sampling": LONG, "kind": "long"}]
    runner = AsyncRollout(client, SingleTurn(), rows, group_size=2, batch_groups=1,
                          max_staleness=1, partial=partial, max_concurrent_groups=2)
    seen_long = []
    with runner:
        first = runner.get_batch(timeout=60)
        assert first.trajectories[0].row["kind"] == "short"
        push(engine, model_path, 0)  # the long group is in flight across this update
        for _ in range(6):
            batch = runner.get_batch(timeout=120)
            seen_long += [t for t in batch.trajectories if t.row["kind"] == "long"]
            if seen_long:
                break
    acc = runner.accounting()
    assert adds_up(acc)
    assert seen_long
    if partial:
        assert acc["carried"] >= 1 and not acc["dropped"].get("unfinished at hand-out")
        carried = seen_long[0]
        assert carried.group_id == 1  # the very group that was running at the first hand-out
        assert carried.versions[0] == "0" and carried.versions[-1] == "1"  # split, labelled
        assert carried.versions == sorted(carried.versions)
        assert len(carried.response_ids) == 120
    else:
        assert acc["dropped"]["unfinished at hand-out"] >= 1 and acc["carried"] == 0
        assert all(v == "1" for t in seen_long for v in t.versions)  # sampled again


class HeldAfterFirstTokens(SingleTurn):
    """SingleTurn, except that a long row's sample stops after its first tokens, says so
    (`first_tokens`), and goes on from prompt + those tokens, as TokenClient resubmits a sample
    a pause interrupted, once the test has pushed (`pushed`): the group is in flight across the
    updates with no race between its tokens and the pushes, however fast or loaded the machine."""

    def __init__(self, first: int = 4):
        super().__init__()
        self.first = first
        self.first_tokens, self.pushed = threading.Event(), threading.Event()

    def run_group(self, client: TokenClient, row: dict, group_size: int, group_id: int,
                  seed: int | None = None) -> list[Trajectory]:
        if row["kind"] != "long":
            return super().run_group(client, row, group_size, group_id, seed)
        prompt = client.encode_row(row)
        budget = row["sampling"]["max_new_tokens"]
        head = client.generate(prompt, max_new_tokens=self.first, seed=seed)[0]
        self.first_tokens.set()
        if not self.pushed.wait(timeout=120):
            raise TimeoutError("the test never pushed")
        tail = client.generate(prompt + head.output_ids, max_new_tokens=budget - self.first,
                               seed=seed)[0]
        traj = Trajectory(prompt_ids=prompt, finish_reason=tail.finish_type, group_id=group_id,
                          row=row, text=head.text + tail.text)
        for part in (head, tail):
            traj.append_generated(part.output_ids, part.logprobs, part.versions)
        return [traj]


@pytest.mark.parametrize("stale", ["mask", "drop"])
def test_tokens_two_versions_old_are_masked_or_dropped(engine, model_path, stale):
    client = TokenClient(engine, sampling={"temperature": 1.0, "ignore_eos": True})
    rows = [{"prompt": "Hello", "sampling": SHORT, "kind": "short"},
            {"prompt": "A long one", "sampling": LONG, "kind": "long"}]
    loop = HeldAfterFirstTokens()
    runner = AsyncRollout(client, loop, rows, group_size=1, batch_groups=1, max_staleness=1,
                          partial=True, stale=stale, max_concurrent_groups=2)
    handed = []
    with runner:
        try:
            first = runner.get_batch(timeout=60)
            assert [t.group_id for t in first.trajectories] == [0]  # the short group
            # Two updates while the long group (group 1) runs: its first tokens are then two
            # versions old.
            assert loop.first_tokens.wait(timeout=60)
            push(engine, model_path, 0)
            push(engine, model_path, 1)
        finally:
            loop.pushed.set()
        for _ in range(6):
            batch = runner.get_batch(timeout=120)
            handed += batch.trajectories
            if (any(t.group_id == 1 for t in batch.trajectories)
                    or runner.accounting()["dropped"].get("stale")):
                break
    acc = runner.accounting()
    assert adds_up(acc)
    if stale == "drop":
        # the group that ran across both updates (group 1) is dropped, never handed out; a
        # later long group sampled after the updates may be handed out in the same batch
        assert acc["dropped"]["stale"] == 1
        assert all(t.group_id != 1 for t in handed)
        assert all(int(v) >= 1 for t in handed for v in t.versions)
        return
    # A later long group, sampled after both updates, may come first; it is kept whole.
    i = next(i for i, t in enumerate(batch.trajectories) if t.group_id == 1)
    mask, versions = batch.loss_mask[i], batch.weight_versions[i]
    head, tail = loop.first, LONG["max_new_tokens"] - loop.first
    assert mask == [0] * head + [1] * tail  # the version-0 tokens masked, the version-2 ones kept
    assert versions == [None] * head + ["2"] * tail
    assert torch.tensor(batch.behavior_logprobs[i])[torch.tensor(mask) == 0].abs().sum() == 0


def step_of(label: str) -> int:
    return int(label.removeprefix("step-"))


def test_staleness_bound_with_step_labels_past_step_9(engine, model_path):
    """The README's labels (weight_version=f"step-{step}"): "step-10" is one version after
    "step-9", for the bound, the admission gate and the lags."""
    assert engine.update_weight_version("step-7")["success"]
    runner = short_groups(engine)
    with runner:
        for step in range(7, 11):
            batch = runner.get_batch(timeout=120)
            assert batch.meta["weight_version"] == f"step-{step}" == engine.get_weight_version()
            lags = [step - step_of(v) for row in batch.weight_versions for v in row]
            assert all(0 <= lag <= 1 for lag in lags)  # never more than 1 behind
            assert batch.meta["staleness"]["max_lag"] == max(lags)
            metrics = batch_metrics(batch, f"step-{step}", runner.client.versions)
            assert metrics["staleness/version_lag_max"] == max(lags)
            assert metrics["staleness/version_lag_mean"] == pytest.approx(sum(lags) / len(lags))
            acc = batch.meta["accounting"]
            assert acc["accepted"] + acc["ready"] + acc["running"] <= (1 + step - 7 + 1) * 2
            push(engine, model_path, step, f"step-{step + 1}")
    assert runner.accounting()["accepted"] == 8


class HeldEngine:
    """The Engine as the rollout calls it, answering at once with 4 tokens of the version it
    serves, except for the prompt [2]: that request waits for `release` and answers with 2
    tokens of the version served when it started and 2 of the one served when released (a
    request that ran across updates under pause mode in_place)."""

    def __init__(self, version: str):
        self.version = version
        self.started, self.release = threading.Event(), threading.Event()

    def get_weight_version(self) -> str:
        return self.version

    def abort_request(self, rid=None, abort_all=False) -> None:
        self.release.set()

    def generate(self, input_ids, sampling_params, return_logprob, rid, **_) -> list[dict]:
        outs = []
        for prompt in input_ids:
            first = self.version
            if prompt == [2] and not self.release.is_set():
                self.started.set()
                assert self.release.wait(60)
            spans = [{"version": first, "start": 0, "end": 2},
                     {"version": self.version, "start": 2, "end": 4}]
            outs += [{"text": "", "output_ids": [7] * 4, "meta_info": {
                "finish_reason": {"type": "length", "matched": None, "message": None},
                "output_token_logprobs": [[-1.0, 7]] * 4, "weight_versions": spans}}
                for _ in range(sampling_params["n"])]
        return outs


@pytest.mark.parametrize("stale", ["mask", "drop"])
@pytest.mark.parametrize("labels, read_between", [
    (("step-8", "step-9", "step-10"), False),  # labels that differ in their number only
    (("0", "step-0", "step-1"), True),  # the engine's "0", then the trainer's labels
])
def test_tokens_two_labels_old_are_masked_or_dropped(labels, read_between, stale):
    """Two versions land while a group runs: its first tokens are two versions old at the
    hand-out. Counted from the labels' numbers, whether the runner saw the middle version or
    not; counted over the versions seen where the labels differ more ("0" -> "step-0": the
    trainer reads the version between its pushes, as get_batch does)."""
    old, middle, new = labels
    engine = HeldEngine(old)
    client = TokenClient(engine)
    runner = AsyncRollout(client, SingleTurn(), [{"input_ids": [1]}, {"input_ids": [2]}],
                          group_size=1, batch_groups=1, max_staleness=1, partial=True,
                          stale=stale, max_concurrent_groups=2)
    with runner:
        assert runner.get_batch(timeout=30).weight_versions == [[old] * 4]
        assert engine.started.wait(30)  # the held group runs under `old`
        engine.version = middle
        if read_between:
            client.weight_version()
        engine.version = new
        engine.release.set()
        handed = []
        while not (any(t.row["input_ids"] == [2] and t.group_id == 1 for t in handed)
                   or runner.accounting()["dropped"].get("stale")):
            handed += runner.get_batch(timeout=30).trajectories
        dropped = runner.accounting()["dropped"]
    held = [t for t in handed if t.group_id == 1]
    if stale == "drop":
        assert dropped == {"stale": 1} and not held
        return
    (traj,) = held
    assert traj.loss_mask == [0, 0, 1, 1] and traj.versions == [None, None, new, new]
    assert traj.logprobs == [0.0, 0.0, -1.0, -1.0]

