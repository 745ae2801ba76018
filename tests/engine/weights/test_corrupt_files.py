"""Corrupt files are bad input: a ValueError naming the file in-process, HTTP 400 over the
server, and nothing changed (version, weights, adapters, and the engine keeps serving)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch
from fixtures import serve, write_tiny_chat_model
from safetensors.torch import save_file

from hotswap.engine import Engine

PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
PROBE = "model.layers.0.self_attn.q_proj.weight"
RANK = 4


def _garbage(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"this is not a safetensors file" * 10)


def _truncate(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


def _index(folder: str, body: str) -> None:
    os.remove(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write(body)


def _index_missing_shard(folder: str) -> None:
    os.rename(os.path.join(folder, "model.safetensors"),
              os.path.join(folder, "model-00001-of-00002.safetensors"))
    weight_map = {"model.norm.weight": "model-00002-of-00002.safetensors",
                  PROBE: "model-00001-of-00002.safetensors"}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


# case -> (how to spoil a copy of the checkpoint folder, what the error says)
CHECKPOINT_CASES: dict[str, tuple[Callable[[str], None], str]] = {
    "garbage": (lambda d: _garbage(os.path.join(d, "model.safetensors")),
                r"model\.safetensors: not a valid safetensors file"),
    "truncated": (lambda d: _truncate(os.path.join(d, "model.safetensors")),
                  r"model\.safetensors: not a valid safetensors file"),
    "index-bad-json": (lambda d: _index(d, '{"weight_map": {'),
                       r"model\.safetensors\.index\.json: not a readable JSON file"),
    "index-no-weight-map": (lambda d: _index(d, '{"metadata": {}}'),
                            r"model\.safetensors\.index\.json: no 'weight_map'"),
    "index-missing-shard": (_index_missing_shard,
                            r"index\.json: shard 'model-00002-of-00002\.safetensors' is missing"),
}


def _lora_tensors(engine: Engine, seed: int) -> dict[str, torch.Tensor]:
    cfg = engine.model_config
    gen = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {f"{prefix}.lora_A.weight": torch.randn(RANK, cfg.hidden_size, generator=gen),
            f"{prefix}.lora_B.weight": torch.randn(cfg.q_size, RANK, generator=gen)}


def _write_adapter(engine: Engine, folder: str, seed: int) -> str:
    os.makedirs(folder, exist_ok=True)
    save_file(_lora_tensors(engine, seed), os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": 8,
                   "target_modules": ["q_proj"]}, f)
    return folder


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


ADAPTER_CASES: dict[str, tuple[Callable[[str], None], str]] = {
    "weights-garbage": (lambda d: _garbage(os.path.join(d, "adapter_model.safetensors")),
                        r"adapter_model\.safetensors: not a valid safetensors file"),
    "weights-truncated": (lambda d: _truncate(os.path.join(d, "adapter_model.safetensors")),
                          r"adapter_model\.safetensors: not a valid safetensors file"),
    "config-bad-json": (lambda d: _write(os.path.join(d, "adapter_config.json"), "{'r': 4"),
                        r"adapter_config\.json: not valid JSON"),
    "config-no-rank": (lambda d: _write(os.path.join(d, "adapter_config.json"),
                                        '{"target_modules": ["q_proj"]}'),
                       r"adapter_config\.json: adapter config 'r' must be a positive integer"),
    "config-no-targets": (lambda d: _write(os.path.join(d, "adapter_config.json"), '{"r": 4}'),
                          r"adapter_config\.json: adapter config 'target_modules'"),
    "config-not-object": (lambda d: _write(os.path.join(d, "adapter_config.json"), "[4]"),
                          r"adapter_config\.json: holds a list, not a JSON object"),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("corrupt-base")))


@pytest.fixture(scope="module")
def engine(model_path: str, tmp_path_factory) -> Iterator[Engine]:
    with Engine(model_path, device="cpu", max_total_tokens=2048) as eng:
        good = str(tmp_path_factory.mktemp("adapter-good"))
        assert eng.load_lora_adapter("a", _write_adapter(eng, good, seed=0))["success"]
        yield eng


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[str]:
    with serve(engine) as srv:
        yield srv.url


def _spoiled_checkpoint(model_path: str, root: str, case: str) -> str:
    folder = os.path.join(root, case)
    shutil.copytree(model_path, folder)
    CHECKPOINT_CASES[case][0](folder)
    return folder


def _spoiled_adapter(engine: Engine, root: str, case: str) -> str:
    folder = _write_adapter(engine, os.path.join(root, case), seed=1)
    ADAPTER_CASES[case][0](folder)
    return folder


def _snapshot(engine: Engine) -> tuple:
    """What must not change: version, a weight, adapters, and greedy outputs with and without
    the adapter (which also shows the engine still serves)."""
    base = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    lora = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_name="a")["output_ids"]
    return (engine.get_weight_version(), engine.get_weights_by_name(PROBE, 16),
            engine.list_lora_adapters(), base, lora, engine.weights.open_update is not None)


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, timeout=60)


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
@pytest.mark.parametrize("method", ["update_weights_from_disk", "prepare_weights_from_disk"])
def test_corrupt_checkpoint_in_process(engine, model_path, tmp_path, case, method):
    folder = _spoiled_checkpoint(model_path, str(tmp_path), case)
    before = _snapshot(engine)
    with pytest.raises(ValueError, match=CHECKPOINT_CASES[case][1]):
        getattr(engine, method)(folder)
    assert _snapshot(engine) == before


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
@pytest.mark.parametrize("route", ["/update_weights_from_disk", "/prepare_weights_from_disk"])
def test_corrupt_checkpoint_over_http(engine, server, model_path, tmp_path, case, route):
    folder = _spoiled_checkpoint(model_path, str(tmp_path), case)
    before = _snapshot(engine)
    reply = _post(server, route, {"model_path": folder})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert folder in error["message"]
    assert _snapshot(engine) == before


@pytest.mark.parametrize("case", list(ADAPTER_CASES))
def test_corrupt_adapter_in_process(engine, tmp_path, case):
    folder = _spoiled_adapter(engine, str(tmp_path), case)
    before = _snapshot(engine)
    for name in ("a", "new"):  # replacing a loaded adapter, and loading a new one
        with pytest.raises(ValueError, match=ADAPTER_CASES[case][1]):
            engine.load_lora_adapter(name, folder)
    assert _snapshot(engine) == before


@pytest.mark.parametrize("case", list(ADAPTER_CASES))
def test_corrupt_adapter_over_http(engine, server, tmp_path, case):
    folder = _spoiled_adapter(engine, str(tmp_path), case)
    before = _snapshot(engine)
    reply = _post(server, "/load_lora_adapter", {"lora_name": "a", "lora_path": folder})
    assert reply.status_code == 400, reply.text
    assert folder in reply.json()["error"]["message"]
    assert _snapshot(engine) == before


def test_index_naming_a_tensor_no_shard_holds(engine, model_path, tmp_path):
    folder = str(tmp_path / "ghost")
    shutil.copytree(model_path, folder)
    os.rename(f"{folder}/model.safetensors", f"{folder}/model-00001-of-00001.safetensors")
    with open(f"{folder}/model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {PROBE: "model-00001-of-00001.safetensors",
                                  "model.layers.9.mlp.up_proj.weight":
                                  "model-00001-of-00001.safetensors"}}, f)
    before = _snapshot(engine)
    with pytest.raises(ValueError, match=r"names 1 tensor\(s\) no shard holds.*layers\.9"):
        engine.update_weights_from_disk(folder)
    assert _snapshot(engine) == before


@pytest.mark.parametrize("case", ["garbage", "index-no-weight-map"])
def test_engine_start_from_a_corrupt_folder(model_path, tmp_path, case):
    folder = _spoiled_checkpoint(model_path, str(tmp_path), case)
    with pytest.raises(ValueError, match=CHECKPOINT_CASES[case][1]):
        Engine(folder, device="cpu", max_total_tokens=2048)
