"""Checkpoint loading: sharded files, and errors that name the tensor or field at fault."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import write_tiny_model
from safetensors.torch import load_file, save_file

from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.executor.model_runner import ModelRunner


def build(path: str) -> ModelRunner:
    mcfg = ModelConfig.from_path(path)
    return ModelRunner(EngineConfig(model_path=path, max_total_tokens=256).resolve(mcfg), mcfg)


@pytest.fixture()
def ckpt(tmp_path) -> str:
    return write_tiny_model(str(tmp_path / "m"), "llama")


def rewrite(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_tensor_is_named(ckpt):
    rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        build(ckpt)


def test_wrong_shape_is_named(ckpt):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 64)

    rewrite(ckpt, edit)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(5, 64\)"):
        build(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    def edit(t):
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)

    rewrite(ckpt, edit)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra"):
        build(ckpt)


def test_integer_dtype_is_refused(ckpt):
    def edit(t):
        t["model.norm.weight"] = torch.ones(64, dtype=torch.int32)

    rewrite(ckpt, edit)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*dtype"):
        build(ckpt)


def test_unknown_architecture_names_the_field(ckpt):
    cfg_path = os.path.join(ckpt, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["MambaForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"architectures.*MambaForCausalLM"):
        build(ckpt)


def test_missing_config_field_is_named(ckpt):
    cfg_path = os.path.join(ckpt, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    del cfg["hidden_size"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="hidden_size"):
        build(ckpt)


def test_sharded_checkpoint_loads_like_a_single_file(ckpt, tmp_path):
    sharded = str(tmp_path / "sharded")
    shutil.copytree(ckpt, sharded)
    os.remove(os.path.join(sharded, "model.safetensors"))
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, os.path.join(sharded, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    a, b = build(ckpt), build(sharded)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name
