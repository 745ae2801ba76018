"""A NaN or inf is refused before any write on the paths test_standby.py and
test_weight_updates.py leave out: staged pieces (tensor and process group) and a two-phase
update from disk, which must fail at prepare (a failure at commit would split the engines)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from fixtures import write_tiny_chat_model
from safetensors.torch import load_file, save_file

from hotswap.engine import Engine
from hotswap.weight_sync import WeightSender, WeightSyncError
from hotswap.weight_sync.group import free_port

PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("non-finite")
    return {"a": write_tiny_chat_model(str(root / "a"), seed=0),
            "b": write_tiny_chat_model(str(root / "b"), seed=1)}


def _poisoned(path: str, value: float) -> dict[str, torch.Tensor]:
    tensors = load_file(f"{path}/model.safetensors")
    last = list(tensors)[-1]
    tensors[last] = tensors[last].clone()
    tensors[last].view(-1)[1] = value
    return tensors


def _outputs(engine: Engine) -> list[int]:
    return engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("path", ["staged-tensor", "staged-distributed", "two-phase-disk"])
def test_non_finite_is_refused_before_any_write(paths, tmp_path, path, value):
    bad = _poisoned(paths["b"], value)
    with Engine(paths["a"], device="cpu", max_total_tokens=2048) as eng:
        before = _outputs(eng)
        if path == "staged-tensor":
            with pytest.raises(ValueError, match="non-finite"):
                eng.update_weights_from_tensor(bad, weight_version="bad", commit=False)
        elif path == "staged-distributed":
            sender = WeightSender("127.0.0.1", free_port(), 2, backend="gloo", timeout_s=30)
            try:
                with pytest.raises(WeightSyncError, match="non-finite"):
                    sender.send(bad, [eng], weight_version="bad", flush_cache=False)
            finally:
                sender.close([eng])
        else:
            folder = str(tmp_path / "bad")
            shutil.copytree(paths["b"], folder)
            save_file(bad, os.path.join(folder, "model.safetensors"))
            with pytest.raises(ValueError, match="non-finite"):
                eng.prepare_weights_from_disk(folder)
            assert eng.weights.open_update is None
        assert not eng.scheduler.paused  # no update was left open, generation is not held
        assert eng.get_weight_version() == "0"
        assert _outputs(eng) == before
