"""One validation of an update's names, dtypes and shapes: every path refuses the same bad update
with the same message, before anything changes."""

from __future__ import annotations

import pytest
import torch
from fixtures import write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine
from hotswap.engine.weights.weight_manager import update_meta
from hotswap.weight_sync import WeightSender, WeightSyncError
from hotswap.weight_sync.group import free_port

PROBE = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("validation")))


def _bad_updates(good: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    norm = good["model.norm.weight"]
    return {"shape": {PROBE: good[PROBE][:-1]},
            "name": {"model.layers.0.mlp.nope.weight": norm},
            "dtype": {"model.norm.weight": norm.to(torch.int64)},
            "several": {PROBE: good[PROBE].t().contiguous(), "lm_head.bias": norm}}


def test_update_meta_checks_the_lists():
    with pytest.raises(ValueError, match="same length, got 2, 1 and 2"):
        update_meta(["a", "b"], ["float32"], [[1], [2]])
    with pytest.raises(ValueError, match="repeats the name 'a'"):
        update_meta(["a", "a"], ["float32"] * 2, [[1], [1]])
    meta = update_meta(["a", "b"], ["torch.bfloat16", "complex7"], [[2, 3], (4,)])
    assert meta == {"a": ((2, 3), torch.bfloat16), "b": ((4,), None)}


def _message(failures: dict[str, str]) -> list[str]:
    return [why.removeprefix("ValueError: ") for why in failures.values()]


def test_every_path_refuses_with_the_same_message(model_path):
    good = load_file(f"{model_path}/model.safetensors")
    kw = dict(device="cpu", max_total_tokens=2048)
    with Engine(model_path, **kw) as one, Engine(model_path, **kw) as two:
        before = one.get_weights_by_name(PROBE, 8)
        for kind, bad in _bad_updates(good).items():
            with pytest.raises(ValueError) as direct:
                one.update_weights_from_tensor(bad)
            with pytest.raises(ValueError) as staged:
                one.update_weights_from_tensor(bad, commit=False)
            assert str(staged.value) == str(direct.value), kind
            want = str(direct.value)
            for targets, world in (([one], 2), ([one, two], 3)):  # distributed, two-phase
                sender = WeightSender("127.0.0.1", free_port(), world, backend="gloo",
                                      timeout_s=30)
                try:
                    with pytest.raises(WeightSyncError) as info:
                        sender.send(bad, targets)
                    assert _message(info.value.failures) == [want] * len(targets), kind
                finally:
                    sender.close(targets)
        for eng in (one, two):
            assert eng.get_weight_version() == "0"
            assert eng.weights.open_update is None
        assert one.get_weights_by_name(PROBE, 8) == before
