"""quantization="int8" under weight updates: every path re-quantizes inside its transaction, so
after an update the engine serves exactly what a fresh int8 engine loaded with the new weights
serves; a refused or aborted update leaves the old int8 copies serving; LoRA adapters stay float
on top of the int8 base."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from fixtures import save_random_lora, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine
from hotswap.engine.layers import quant
from hotswap.engine.layers.linear import quantized_linears
from hotswap.weight_sync import WeightSender
from hotswap.weight_sync.group import free_port

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45, 46], [7, 300, 12]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("quantized-updates")
    return {"a": write_tiny_chat_model(str(root / "a"), seed=0),
            "b": write_tiny_chat_model(str(root / "b"), seed=1)}


@contextlib.contextmanager
def int8_engine(path: str, **kwargs) -> Iterator[Engine]:
    kwargs = {"dtype": "float32", "quantization": "int8", "max_total_tokens": 2048, **kwargs}
    with Engine(path, **kwargs) as engine:
        yield engine
        engine.check_integrity()


def outputs(engine: Engine) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def int8_copies(engine: Engine) -> list[quant.QuantWeight]:
    return [m.quant for m in quantized_linears(engine.scheduler.runner.model)]


def snapshot(engine: Engine) -> list[list[torch.Tensor]]:
    """The int8 copies' values (an update rewrites them in place)."""
    return [[t.clone() for t in copy if t is not None] for copy in int8_copies(engine)]


def same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y))
               for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def expected(paths) -> dict[str, object]:
    """What a fresh int8 engine serves from checkpoint b, and its int8 copies."""
    with int8_engine(paths["b"]) as fresh:
        return {"outputs": outputs(fresh), "copies": snapshot(fresh)}


def sender_update(engines: list[Engine], tensors: dict, **kwargs) -> None:
    sender = WeightSender("127.0.0.1", free_port(), 1 + len(engines), backend="gloo",
                          timeout_s=30)
    try:
        sender.send(tensors, engines, weight_version="b", **kwargs)
    finally:
        sender.close(engines)


def update(engine: Engine, path: str, how: str) -> None:
    tensors = load_file(f"{path}/model.safetensors")
    names = list(tensors)
    if how == "tensor":
        assert engine.update_weights_from_tensor(tensors, weight_version="b")["success"]
    elif how == "disk":
        assert engine.update_weights_from_disk(path, weight_version="b")["success"]
    elif how in ("distributed-standby", "distributed-in-place"):
        sender_update([engine], tensors, staging="standby" if how.endswith("standby") else "none")
    elif how == "staged":
        half = len(names) // 2
        for part in (names[:half], names[half:]):
            engine.update_weights_from_tensor({n: tensors[n] for n in part}, commit=False)
        assert engine.commit_weight_update("b")["success"]
    elif how == "two-phase-disk":
        engine.prepare_weights_from_disk(path)
        assert engine.commit_weight_update("b")["success"]
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["tensor", "disk", "distributed-standby", "distributed-in-place",
                                 "staged", "two-phase-disk"])
def test_every_update_path_requantizes(paths, expected, how):
    with int8_engine(paths["a"]) as engine:
        before = outputs(engine)
        update(engine, paths["b"], how)
        assert engine.get_weight_version() == "b"
        if how != "staged":
            assert "quantize" in engine.weights.last_stages  # inside the transaction
        after = outputs(engine)
    assert after != before
    assert after == expected["outputs"]


def test_two_phase_distributed_requantizes_every_target(paths, expected):
    with int8_engine(paths["a"]) as one, int8_engine(paths["a"]) as two:
        sender_update([one, two], load_file(f"{paths['b']}/model.safetensors"))
        for engine in (one, two):
            assert engine.get_weight_version() == "b"
            assert outputs(engine) == expected["outputs"]
            assert same(snapshot(engine), expected["copies"])


def test_updates_rewrite_the_int8_copies_in_place(paths, expected):
    """An update writes the new int8 copies into the old ones' memory (fresh pages inside the
    transaction would cost more than quantizing); releasing the weights frees them, and the
    update after the resume builds them again."""
    with int8_engine(paths["a"]) as engine:
        where = [[t.data_ptr() for t in copy if t is not None] for copy in int8_copies(engine)]
        update(engine, paths["b"], "tensor")
        assert [[t.data_ptr() for t in c if t is not None] for c in int8_copies(engine)] == where
        assert same(snapshot(engine), expected["copies"])
        assert engine.release_memory_occupation(["weights"])["success"]
        assert all(copy is None for copy in int8_copies(engine))
        assert engine.resume_memory_occupation(["weights"])["success"]
        update(engine, paths["b"], "tensor")
        assert same(snapshot(engine), expected["copies"])
        assert outputs(engine) == expected["outputs"]


def test_tensor_parallel_requantizes(paths):
    with int8_engine(paths["b"], tp_size=2) as fresh:
        want = outputs(fresh)
    with int8_engine(paths["a"], tp_size=2) as engine:
        update(engine, paths["b"], "tensor")
        assert outputs(engine) == want


def test_nan_update_refused_old_int8_serving(paths):
    tensors = load_file(f"{paths['b']}/model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = float("nan")
    with int8_engine(paths["a"]) as engine:
        before, copies = outputs(engine), snapshot(engine)
        with pytest.raises(ValueError, match="non-finite"):
            engine.update_weights_from_tensor(tensors, weight_version="bad")
        assert engine.get_weight_version() == "0"
        assert same(snapshot(engine), copies)
        assert outputs(engine) == before


def test_aborted_two_phase_update_leaves_old_int8_serving(paths):
    with int8_engine(paths["a"]) as engine:
        before, copies = outputs(engine), snapshot(engine)
        engine.prepare_weights_from_disk(paths["b"])
        engine.abort_weight_update()
        assert engine.get_weight_version() == "0"
        assert same(snapshot(engine), copies)
        assert outputs(engine) == before


def test_lora_on_int8_base(paths, tmp_path):
    """The adapter's float delta on top of the int8 base: close to PEFT in fp32, and it stays
    loaded and correct across a base update."""
    pm = save_random_lora(paths["a"], str(tmp_path / "adapter"),
                          ["q_proj", "v_proj", "o_proj", "down_proj"], seed=3)
    prompt = PROMPTS[0]
    with int8_engine(paths["a"]) as engine:
        engine.load_lora_adapter("a", str(tmp_path / "adapter"))
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_name="a",
                              return_logprob=True)
        plain = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        assert out["output_ids"] != plain["output_ids"]  # the adapter acts
        ids = out["output_ids"]
        with torch.no_grad():
            logits = pm(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
        ref = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        ours = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
        assert (ours - ref).abs().max() < 0.3 and (ours - ref).abs().mean() < 0.05
