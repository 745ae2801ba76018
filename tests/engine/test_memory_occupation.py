"""release/resume_memory_occupation: weights and KV memory freed between rollouts."""

from __future__ import annotations

import threading

import pytest

from hotswap.engine import Engine
from hotswap.engine.errors import WeightsIncompleteError

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture()
def engine(tiny_chat_model_path):
    with Engine(tiny_chat_model_path, max_total_tokens=4096) as eng:
        yield eng


def param_elements(engine: Engine) -> int:
    return sum(p.numel() for p in engine.runner.model.parameters())


def test_release_both_then_push_weights(engine, tiny_chat_model_path):
    before = engine.generate(prompt="Hello world", sampling_params=GREEDY)["output_ids"]
    assert engine.release_memory_occupation()["success"]
    assert param_elements(engine) == 0 and not engine.runner.kv_pool.allocated
    with pytest.raises(WeightsIncompleteError):
        engine.generate(prompt="Hello world", sampling_params=GREEDY)
    with pytest.raises(ValueError, match="resume_memory_occupation"):
        engine.update_weights_from_disk(tiny_chat_model_path)
    assert engine.resume_memory_occupation()["success"]
    assert param_elements(engine) > 0 and engine.runner.kv_pool.allocated
    with pytest.raises(WeightsIncompleteError):  # storage is back, values are not
        engine.generate(prompt="Hello world", sampling_params=GREEDY)
    assert engine.update_weights_from_disk(tiny_chat_model_path)["success"]
    assert engine.generate(prompt="Hello world", sampling_params=GREEDY)["output_ids"] == before
    engine.check_integrity()


def test_requests_wait_while_kv_cache_is_released(engine):
    before = engine.generate(prompt="Hello world", sampling_params=GREEDY)["output_ids"]
    assert engine.release_memory_occupation(["kv_cache"])["success"]
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        out=engine.generate(prompt="Hello world", sampling_params=GREEDY)))
    worker.start()
    worker.join(timeout=1.0)
    assert worker.is_alive()  # queued, not served
    assert engine.resume_memory_occupation(["kv_cache"])["success"]
    worker.join(timeout=30)
    assert result["out"]["output_ids"] == before
    engine.check_integrity()


def test_release_refuses_while_requests_are_queued(engine):
    stream = engine.generate(prompt="Go", sampling_params={**GREEDY, "max_new_tokens": 5000},
                             stream=True)
    next(stream)
    out = engine.release_memory_occupation(["kv_cache"])
    assert not out["success"] and "running" in out["message"]
    stream.close()
    with pytest.raises(ValueError, match="tags"):
        engine.release_memory_occupation(["gpu"])
