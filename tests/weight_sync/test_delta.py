"""Delta weight updates (weight_sync/delta.py): a trainer pushing only what changed ends with
engine weights bitwise equal to full pushes of the same trainer weights, whatever is refused,
aborted or fallen back on the way. The reference is a second engine that got full pushes."""

from __future__ import annotations

import pytest
import torch
import transformers
from fixtures import write_tiny_chat_model

from hotswap.engine import Engine
from hotswap.weight_sync import (
    Delta,
    DeltaTracker,
    WeightSender,
    WeightSyncError,
    update_in_process,
)
from hotswap.weight_sync.delta import BLOCKS, FULL, NONE, SPARSE
from hotswap.weight_sync.group import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("delta")))


def engine(path: str, dtype: str) -> Engine:
    return Engine(path, dtype=dtype, max_total_tokens=1024)


def sender(name: str, world_size: int = 2) -> WeightSender:
    return WeightSender("127.0.0.1", free_port(), world_size=world_size, group_name=name,
                        backend="gloo", timeout_s=60)


def trainer(path: str, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def step(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    optim.zero_grad()
    loss.backward()
    optim.step()


def named(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


def assert_same_weights(a: Engine, b: Engine) -> None:
    for name, slot in a.runner.weight_map.items():
        assert torch.equal(slot.view, b.runner.weight_map[name].view), name


class StaleVersion:
    """A target that reports the version the sender last saw (a race: the engine moved on
    between the sender's look and the push)."""

    def __init__(self, engine: Engine, reported: str):
        self.engine, self.reported = engine, reported

    def get_weight_version(self) -> str:
        return self.reported

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_twenty_delta_pushes_equal_full_pushes_bitwise(model_path, dtype, lr):
    model, optim = trainer(model_path, lr)
    by_delta, by_full = sender("delta"), sender("full")
    with engine(model_path, dtype) as delta_engine, engine(model_path, dtype) as full_engine:
        kinds, fractions = [], []
        for i in range(20):
            step(model, optim, i)
            by_delta.send(named(model), [delta_engine], delta=True)
            by_full.send(named(model), [full_engine])
            assert_same_weights(delta_engine, full_engine)
            assert delta_engine.get_weight_version() == full_engine.get_weight_version()
            kinds.append(by_delta.last_push["kind"])
            fractions.append(by_delta.last_push["changed_fraction"])
        by_delta.close([delta_engine])
        by_full.close([full_engine])
    if dtype == "bfloat16":  # most bf16 values do not move in one small step
        assert kinds == ["full"] + ["delta"] * 19 and max(fractions[1:]) < 0.3
    else:  # AdamW moves every float32 element: the sampled estimate chooses full pushes
        assert kinds == ["full"] * 20 and min(fractions[1:]) > 0.5


def test_float32_deltas_of_a_partly_frozen_trainer_equal_full_pushes(model_path):
    """Only the norms train: few float32 elements change, and deltas carry them."""
    model, _ = trainer(model_path, 1e-5)
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    by_delta, by_full = sender("delta"), sender("full")
    with engine(model_path, "float32") as delta_engine, \
            engine(model_path, "float32") as full_engine:
        kinds = []
        for i in range(20):
            step(model, optim, i)
            by_delta.send(named(model), [delta_engine], delta=True)
            by_full.send(named(model), [full_engine])
            assert_same_weights(delta_engine, full_engine)
            kinds.append(by_delta.last_push["kind"])
        by_delta.close([delta_engine])
        by_full.close([full_engine])
    assert kinds == ["full"] + ["delta"] * 19


def test_in_process_updates_send_deltas_and_fall_back(model_path):
    model, optim = trainer(model_path, 1e-6)
    tracker = DeltaTracker(torch.bfloat16)
    with engine(model_path, "bfloat16") as e, engine(model_path, "bfloat16") as reference:
        kinds = []
        for i in range(4):
            step(model, optim, i)
            if i == 2:
                e.update_weight_version("elsewhere")  # another writer: the next push is full
            reply, pushed = update_in_process(e, named(model), tracker)
            assert reply["success"]
            reference.update_weights_from_tensor(named(model))
            assert_same_weights(e, reference)
            kinds.append(pushed["kind"])
    assert kinds == ["full", "delta", "full", "delta"]


def test_a_delta_on_another_base_is_refused_then_pushed_in_full(model_path):
    model, optim = trainer(model_path, 1e-5)
    by_delta, by_full = sender("delta"), sender("full")
    with engine(model_path, "bfloat16") as e, engine(model_path, "bfloat16") as reference:
        step(model, optim, 0)
        by_delta.send(named(model), [e], delta=True)
        by_full.send(named(model), [reference])
        # the engine moves on behind the sender's back (another writer relabels it)
        e.update_weight_version("elsewhere")
        stale = StaleVersion(e, by_delta.delta.base_version)
        step(model, optim, 1)
        by_delta.send(named(model), [stale], delta=True)
        by_full.send(named(model), [reference])
        assert by_delta.last_push["kind"] == "full"  # the delta was refused: full by itself
        assert_same_weights(e, reference)
        step(model, optim, 2)
        by_delta.send(named(model), [e], delta=True)
        by_full.send(named(model), [reference])
        assert by_delta.last_push["kind"] == "delta"
        assert_same_weights(e, reference)
        by_delta.close([e])
        by_full.close([reference])


def test_a_delta_against_the_wrong_base_changes_nothing(model_path):
    model, _ = trainer(model_path, 1e-5)
    with engine(model_path, "float32") as e:
        tracker = DeltaTracker(torch.float32)
        tracker.committed_full("not-served", named(model))
        moved = [(n, t + 1) for n, t in named(model)]
        delta, _ = tracker.encode(moved)
        before = e.get_weights_by_name("model.norm.weight")
        with pytest.raises(ValueError, match="delta against version 'not-served'"):
            e.update_weights_from_tensor(delta, load_format="delta")
        assert e.get_weight_version() == "0"
        assert e.get_weights_by_name("model.norm.weight") == before
        assert e.weights.open_update is None


def test_a_nan_inside_a_delta_is_refused_with_nothing_changed(model_path):
    model, optim = trainer(model_path, 1e-5)
    push = sender("delta")
    with engine(model_path, "float32") as e:
        step(model, optim, 0)
        push.send(named(model), [e], delta=True)
        version, before = e.get_weight_version(), e.get_weights_by_name("model.norm.weight")
        with torch.no_grad():
            model.model.norm.weight[3] = float("nan")
        with pytest.raises(WeightSyncError, match="non-finite"):
            push.send(named(model), [e], delta=True)  # the delta, then the full push: refused
        assert e.get_weight_version() == version
        assert e.get_weights_by_name("model.norm.weight") == before
        push.close([e])

        tracker = DeltaTracker(torch.float32)
        tracker.committed_full(version, [(n, s.view) for n, s in e.runner.weight_map.items()])
        delta, _ = tracker.encode([("model.norm.weight", torch.full_like(
            e.runner.weight_map["model.norm.weight"].view, float("inf")))])
        with pytest.raises(ValueError, match="non-finite"):
            e.update_weights_from_tensor(delta, load_format="delta")
        assert e.get_weight_version() == version


def test_two_targets_one_refusing_stay_on_one_version(model_path):
    model, optim = trainer(model_path, 1e-5)
    push, by_full = sender("delta", world_size=3), sender("full")
    with engine(model_path, "float32") as a, engine(model_path, "float32") as b, \
            engine(model_path, "float32") as reference:
        step(model, optim, 0)
        push.send(named(model), [a, b], delta=True)
        by_full.send(named(model), [reference])
        b.update_weight_version("moved")  # b no longer serves the delta's base
        # Phase one directly: a prepares, b refuses; the coordinator aborts a.
        tracker = push.delta
        step(model, optim, 1)
        delta, _ = tracker.encode(named(model))
        assert a.prepare_weights_from_tensor(delta)["success"]
        with pytest.raises(ValueError, match="delta against version"):
            b.prepare_weights_from_tensor(delta)
        a.abort_weight_update()
        assert a.get_weight_version() == tracker.base_version and b.get_weight_version() == "moved"
        # Through the sender: b refuses the delta, so neither commits it, then both get it full.
        push.send(named(model), [a, StaleVersion(b, tracker.base_version)], delta=True)
        by_full.send(named(model), [reference])
        assert push.last_push["kind"] == "full"
        assert a.get_weight_version() == b.get_weight_version()
        assert_same_weights(a, reference)
        assert_same_weights(b, reference)
        push.close([a, b])
        by_full.close([reference])


def test_each_tensor_takes_its_cheapest_form():
    tracker = DeltaTracker(torch.float32)
    base = {"none": torch.zeros(1000), "sparse": torch.zeros(1000), "blocks": torch.zeros(4096),
            "full": torch.zeros(1000), "tail": torch.zeros(4196)}
    tracker.committed_full("0", base.items())
    new = {k: v.clone() for k, v in base.items()}
    new["sparse"][[3, 500]] = 1.0
    new["blocks"][256:512] = 2.0
    new["full"] += 3.0
    new["tail"][3840:] = 4.0  # a whole block and the last, partial one
    delta, rounded = tracker.encode(list(new.items()))
    assert isinstance(delta, Delta) and delta.base_version == "0"
    assert dict(zip([s.name for s in delta.specs], delta.codes)) == {
        "none": NONE, "sparse": SPARSE, "blocks": BLOCKS, "full": FULL, "tail": BLOCKS}
    out = {k: v.clone() for k, v in base.items()}
    delta.apply(out)
    assert all(torch.equal(out[k], new[k]) for k in new)
