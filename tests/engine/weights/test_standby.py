"""Distributed updates through the standby buffer: received and checked beside the live weights,
then swapped in (or copied, when small); a NaN or inf is refused before any write, on the direct
and the two-phase path; weight_staging="none" receives in place."""

from __future__ import annotations

import pytest
import torch
from fixtures import write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine
from hotswap.engine.errors import WeightsIncompleteError
from hotswap.engine.layers import cpu_kernels
from hotswap.weight_sync import WeightSender, WeightSyncError
from hotswap.weight_sync.group import free_port

PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("standby")
    return {"a": write_tiny_chat_model(str(root / "a"), seed=0),
            "b": write_tiny_chat_model(str(root / "b"), seed=1),
            "c": write_tiny_chat_model(str(root / "c"), seed=2)}


def _engine(path: str, **kwargs) -> Engine:
    return Engine(path, device="cpu", max_total_tokens=2048, **kwargs)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(f"{path}/model.safetensors")


def _poisoned(tensors: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    last = list(tensors)[-1]
    bad = tensors[last].clone()
    bad.view(-1)[3] = value
    return {**tensors, last: bad}


def _send(targets: list[Engine], tensors: dict, **kwargs) -> list[dict]:
    sender = WeightSender("127.0.0.1", free_port(), 1 + len(targets), backend="gloo",
                          bucket_bytes=64 << 10, timeout_s=30)
    try:
        return sender.send(tensors, targets, **kwargs)
    finally:
        sender.close(targets)


def _outputs(engine: Engine) -> list[int]:
    return engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


def _assert_weights(engine: Engine, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        got = engine.weights.runner.weight_map[name].view
        assert torch.equal(got, tensor.to(got.dtype)), name


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_broadcast_is_refused_before_any_write(paths, load_format, value):
    with _engine(paths["a"]) as eng:
        before = _outputs(eng)
        with pytest.raises(WeightSyncError, match="non-finite"):
            _send([eng], _poisoned(_tensors(paths["b"]), value), weight_version="bad",
                  load_format=load_format)
        assert eng.get_weight_version() == "0"
        assert _outputs(eng) == before  # still serving, the old weights
        _assert_weights(eng, _tensors(paths["a"]))
        assert _send([eng], _tensors(paths["b"]), load_format=load_format)[0]["success"]
        _assert_weights(eng, _tensors(paths["b"]))


def test_two_phase_refuses_non_finite_at_prepare(paths):
    with _engine(paths["a"]) as one, _engine(paths["a"]) as two:
        before = _outputs(one)
        with pytest.raises(WeightSyncError, match="no target committed"):
            _send([one, two], _poisoned(_tensors(paths["b"]), float("nan")))
        for eng in (one, two):
            assert eng.get_weight_version() == "0" and eng.weights.open_update is None
            assert _outputs(eng) == before
            assert eng.weights.standby.acquire()  # given back
            eng.weights.standby.release()
        assert [r["weight_version"] for r in _send([one, two], _tensors(paths["b"]))] == ["1"] * 2
        with _engine(paths["b"]) as fresh:
            want = _outputs(fresh)
        assert _outputs(one) == _outputs(two) == want


@pytest.mark.parametrize("huge", [False, True])
def test_swap_then_partial_updates_keep_every_tensor(paths, huge, monkeypatch):
    """A complete update swaps buffers; a later one that leaves a tensor out still serves that
    tensor's latest value (copied into the standby first); a small one is copied in. With
    `huge`, both buffers are huge_empty regions (as a real model's are on CPU; the tiny model
    is under 2 MiB, so the test lowers the page size)."""
    if huge:
        monkeypatch.setattr(cpu_kernels, "HUGE_PAGE", 4096)
    b, c = _tensors(paths["b"]), _tensors(paths["c"])
    with _engine(paths["a"]) as eng:
        norm = eng.weights.runner.weight_map["model.norm.weight"].param
        live, buffer = norm.data_ptr(), norm.untyped_storage().data_ptr()
        assert _send([eng], b)[0]["success"]
        assert norm.data_ptr() != live
        if huge:  # the live buffer and the standby swapped in both start on a page
            assert buffer % 4096 == norm.untyped_storage().data_ptr() % 4096 == 0
        assert set(eng.weights.last_stages) >= {"validate", "receive", "check", "install"}
        most = {n: t for n, t in c.items() if n != "model.norm.weight"}
        assert _send([eng], most, weight_version="most")[0]["success"]
        _assert_weights(eng, {**most, "model.norm.weight": b["model.norm.weight"]})
        one = {"model.norm.weight": c["model.norm.weight"]}
        assert _send([eng], one, weight_version="one")[0]["success"]
        _assert_weights(eng, c)
        with _engine(paths["c"]) as fresh:
            assert _outputs(eng) == _outputs(fresh)


def test_another_dtype_is_converted_into_the_standby(paths):
    b16 = {n: t.to(torch.bfloat16) for n, t in _tensors(paths["b"]).items()}
    with _engine(paths["a"], dtype="float32") as eng:
        assert _send([eng], b16, load_format=None)[0]["success"]
        _assert_weights(eng, b16)


def test_staging_none_receives_in_place(paths):
    with _engine(paths["a"], weight_staging="none") as eng:
        live = eng.weights.runner.weight_map["model.norm.weight"].param.data_ptr()
        with pytest.raises(WeightSyncError, match="non-finite"):
            _send([eng], _poisoned(_tensors(paths["b"]), float("nan")))
        with pytest.raises(WeightsIncompleteError, match="non-finite"):
            eng.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert _send([eng], _tensors(paths["b"]))[0]["success"]
        assert eng.weights.runner.weight_map["model.norm.weight"].param.data_ptr() == live
        assert eng.weights.standby.flat is None  # never allocated
        _assert_weights(eng, _tensors(paths["b"]))


def test_per_call_staging_none_receives_in_place_until_a_complete_update(paths):
    """staging="none" on one call of a standby engine: in place, no standby allocated; a NaN
    then leaves the engine refusing generation until a complete update."""
    with _engine(paths["a"]) as eng:
        live = eng.weights.runner.weight_map["model.norm.weight"].param.data_ptr()
        with pytest.raises(WeightSyncError, match="non-finite"):
            _send([eng], _poisoned(_tensors(paths["b"]), float("nan")), staging="none")
        assert eng.get_weight_version() == "0"
        with pytest.raises(WeightsIncompleteError, match="non-finite"):
            _outputs(eng)
        assert _send([eng], _tensors(paths["b"]), staging="none")[0]["success"]
        assert eng.weights.runner.weight_map["model.norm.weight"].param.data_ptr() == live
        assert eng.weights.standby.flat is None
        _assert_weights(eng, _tensors(paths["b"]))
        with _engine(paths["b"]) as fresh:
            assert _outputs(eng) == _outputs(fresh)


def test_per_call_staging_standby_refuses_a_nan_on_an_in_place_engine(paths):
    with _engine(paths["a"], weight_staging="none") as eng:
        before = _outputs(eng)
        with pytest.raises(WeightSyncError, match="non-finite"):
            _send([eng], _poisoned(_tensors(paths["b"]), float("inf")), staging="standby",
                  weight_version="bad")
        assert eng.get_weight_version() == "0"
        assert _outputs(eng) == before
        _assert_weights(eng, _tensors(paths["a"]))


@pytest.mark.parametrize("staging", ["", "inplace", "None", 1])
def test_a_bad_staging_is_refused_with_nothing_changed(paths, staging):
    """Refused before the receive, the broadcast still drained: the next update goes through."""
    with _engine(paths["a"]) as eng:
        before = _outputs(eng)
        with pytest.raises(WeightSyncError, match="staging must be one of"):
            _send([eng], _tensors(paths["b"]), staging=staging)
        assert eng.get_weight_version() == "0" and eng.weights.standby.flat is None
        assert _outputs(eng) == before
        _assert_weights(eng, _tensors(paths["a"]))


def test_staging_none_is_refused_where_it_cannot_be_all_or_none(paths):
    with _engine(paths["a"]) as one, _engine(paths["a"]) as two:
        sender = WeightSender("127.0.0.1", free_port(), 3, backend="gloo", timeout_s=30)
        with pytest.raises(ValueError, match="two-phase"):
            sender.send(_tensors(paths["b"]), [one, two], staging="none")
        assert not sender.connected  # refused before the group was made
        assert one.get_weight_version() == two.get_weight_version() == "0"
    with pytest.raises(ValueError, match="tp_size"):
        _engine(paths["a"], tp_size=2, weight_staging="none")
