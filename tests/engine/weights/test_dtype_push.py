"""An fp32 trainer pushing into a bf16 engine over gloo (the common RL case): the tensors are
converted as they land (weight_sync/receiver.py), per load_format and staging.

The reference is torch's own rounding (`t.to(torch.bfloat16)`, to nearest even) for the
weights, and a fresh bf16 engine loaded from the fp32 checkpoint for the generations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torchrun_sender import TrainerError, TrainerProcess, free_port, perturbed, save_checkpoint

from hotswap.engine import Engine
from hotswap.weight_sync import WeightSender
from hotswap.weight_sync.rpc import RpcServer

pytestmark = pytest.mark.slow
PROMPTS = ["The quick brown fox", "Once upon a time,", "def fibonacci(n):"]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def trainer() -> Iterator[TrainerProcess]:
    proc = TrainerProcess()
    yield proc
    proc.close()


def bf16_engine(path: str, **kwargs) -> Engine:
    return Engine(path, dtype="bfloat16", max_total_tokens=4096, weight_update_timeout_s=30,
                  **kwargs)


@contextlib.contextmanager
def linked(engine: Engine, trainer: TrainerProcess) -> Iterator[None]:
    with RpcServer(engine) as server:
        trainer.call("connect", address=server.address, authkey=server.authkey,
                     master_port=free_port(), bucket_bytes=1 << 20, timeout_s=30)
        try:
            yield
        finally:
            trainer.call("close")


def outputs(engine: Engine) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(prompt=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def assert_weights_are_rounded(engine: Engine, tensors: dict[str, torch.Tensor]) -> None:
    weight_map = engine.runner.weight_map
    for name, tensor in tensors.items():
        assert torch.equal(weight_map[name].view, tensor.to(torch.bfloat16)), name


@pytest.mark.parametrize("staging", ["standby", "none"])
@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_fp32_push_into_bf16_equals_a_fresh_bf16_engine(trainer, tiny_chat_model_path, tmp_path,
                                                        load_format, staging):
    v1 = perturbed(tiny_chat_model_path, seed=5)
    ref = save_checkpoint(v1, tiny_chat_model_path, str(tmp_path / "ref"))
    trainer.call("put", key="v1", tensors=v1)
    trainer.call("put", key="v2", tensors=perturbed(tiny_chat_model_path, seed=6))
    with bf16_engine(tiny_chat_model_path) as engine, linked(engine, trainer):
        before = outputs(engine)
        for key in ("v2", "v1"):  # the second push lands in the buffers the first one left
            out = trainer.call("send", key=key, weight_version=key, load_format=load_format,
                               staging=staging)
            assert out["replies"][0]["weight_version"] == key
        assert_weights_are_rounded(engine, v1)
        after = outputs(engine)
    with bf16_engine(ref) as fresh:
        assert after == outputs(fresh)
    assert after != before


def test_a_finite_fp32_value_beyond_bf16_range_is_refused(trainer, tiny_chat_model_path):
    """3.4e38 is finite in fp32 and rounds to inf in bf16: what the engine would serve is
    checked, so the update is refused before any write."""
    tensors = perturbed(tiny_chat_model_path, seed=7)
    trainer.call("put", key="good", tensors=tensors)
    last = list(tensors)[-1]
    huge = tensors[last].clone()
    huge.view(-1)[2] = 3.4e38
    trainer.call("put", key="huge", tensors={**tensors, last: huge})
    with bf16_engine(tiny_chat_model_path) as engine, linked(engine, trainer):
        before = outputs(engine)
        with pytest.raises(TrainerError, match=rf"'{last}'.*non-finite"):
            trainer.call("send", key="huge", weight_version="bad")
        assert engine.get_weight_version() == "0"
        assert engine.flush_cache()["success"]  # the same batches as before: equal bits
        assert outputs(engine) == before
        assert trainer.call("send", key="good", weight_version="v1")["replies"][0]["success"]
        assert_weights_are_rounded(engine, tensors)


def test_a_sender_rounds_for_a_bf16_engine_as_the_engine_would(tiny_chat_model_path, tmp_path):
    """An Engine target reports its weights' dtype: the sender rounds the fp32 tensors before
    the wire (half the bytes), and the engine ends where a fresh bf16 engine starts."""
    v1 = perturbed(tiny_chat_model_path, seed=8)
    ref = save_checkpoint(v1, tiny_chat_model_path, str(tmp_path / "ref"))
    with bf16_engine(tiny_chat_model_path) as engine:
        sender = WeightSender("127.0.0.1", free_port(), 2, backend="gloo", bucket_bytes=1 << 20,
                              timeout_s=30)
        try:
            sender.send(v1, [engine], weight_version="v1")
        finally:
            sender.close([engine])
        assert sender.last_push["bytes"] == sum(t.numel() * 2 for t in v1.values())
        assert_weights_are_rounded(engine, v1)
        after = outputs(engine)
    with bf16_engine(ref) as fresh:
        assert after == outputs(fresh)
