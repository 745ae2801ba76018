"""Updates sent in pieces (commit=False) of one transaction (engine/weights/transaction.py),
the host weight copy across release, and the version relabel, on a tiny random Llama in this
process.

The reference for a staged update is a second engine, loaded from the same checkpoint, that
received the same tensors in one committed call.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from fixtures import write_tiny_chat_model

from hotswap.engine import Engine
from hotswap.engine.errors import WeightsIncompleteError

pytestmark = pytest.mark.slow
PROMPTS = [[5, 9, 33, 40, 7], [100, 101, 102], [60, 61, 62, 63, 64, 65, 66]]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("staging")))


def engine(path: str, **kwargs) -> Engine:
    return Engine(path, max_total_tokens=2048, **kwargs)


def new_weights(e: Engine, seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the model, perturbed: a step of training."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, slot in e.runner.weight_map.items():
        base = slot.view.detach().clone()
        out.append((name, base + 0.05 * torch.randn(base.shape, generator=gen)))
    return out


def tokens(e: Engine) -> list[list[int]]:
    return [o["output_ids"] for o in e.generate(None, GREEDY, PROMPTS)]


def test_staged_pieces_commit_as_one_version_equal_to_one_call(model_path):
    with engine(model_path) as staged, engine(model_path) as reference:
        before = tokens(staged)
        weights = new_weights(staged)
        assert reference.update_weights_from_tensor(weights)["success"]
        half = len(weights) // 2
        first = staged.update_weights_from_tensor(weights[:half], commit=False)
        assert first["success"] and first["weight_version"] == "0"
        assert staged.get_weight_version() == "0"
        staged.update_weights_from_tensor(weights[half:], None, False, commit=False)
        result = staged.commit_weight_update("step-1")
        assert result["success"] and staged.get_weight_version() == "step-1"
        after = tokens(staged)
        assert after == tokens(reference)
        assert after != before
        staged.check_integrity()


def test_generation_is_held_during_a_stage_and_runs_on_the_new_weights(model_path):
    with engine(model_path) as e, engine(model_path) as reference:
        weights = new_weights(e, seed=2)
        reference.update_weights_from_tensor(weights)
        e.update_weights_from_tensor(weights[:3], commit=False)
        outs: list = []
        worker = threading.Thread(target=lambda: outs.append(e.generate(None, GREEDY, PROMPTS)))
        worker.start()
        time.sleep(0.5)
        assert not outs, "a request ran while the stage was half written"
        e.update_weights_from_tensor(weights[3:], commit=False)
        assert e.flush_cache()["success"]  # SGLang trainers end a bucketed update with a flush
        worker.join(timeout=60)
        assert [o["output_ids"] for o in outs[0]] == tokens(reference)
        assert {o["meta_info"]["weight_version"] for o in outs[0]} == {"1"}


def test_running_requests_are_retracted_and_finish_under_the_new_version(model_path):
    with engine(model_path) as e:
        weights = new_weights(e, seed=3)
        long = {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}
        stream = e.generate(None, long, PROMPTS[0], stream=True)
        next(stream)
        e.update_weights_from_tensor(weights[:2], commit=False)
        e.update_weights_from_tensor(weights[2:], commit=True, weight_version="v2")
        final = list(stream)[-1]
        spans = final["meta_info"]["weight_versions"]
        assert spans[0]["version"] == "0" and spans[-1]["version"] == "v2"
        assert all(s["version"] in ("0", "v2") for s in spans)


def test_continue_generation_commits_a_stage_opened_after_a_pause(model_path):
    with engine(model_path) as e:
        e.pause_generation("retract")
        e.update_weights_from_tensor(new_weights(e, seed=4), commit=False, weight_version="7")
        assert e.get_weight_version() == "0"
        assert "updated to version '7'" in e.continue_generation()["message"]
        out = e.generate(None, GREEDY, PROMPTS[1])
        assert out["meta_info"]["weight_version"] == "7"


def test_a_bad_piece_leaves_the_stage_open_and_unwritten(model_path):
    with engine(model_path) as e, engine(model_path) as reference:
        weights = new_weights(e, seed=5)
        reference.update_weights_from_tensor(weights)
        e.update_weights_from_tensor(weights[:2], commit=False)
        name, tensor = weights[2]
        with pytest.raises(ValueError, match="shape"):
            e.update_weights_from_tensor([(name, tensor[:1])], commit=False)
        e.update_weights_from_tensor(weights[2:], commit=False)
        e.commit_weight_update()
        assert tokens(e) == tokens(reference)


def test_an_aborted_stage_refuses_generation_until_a_complete_update(model_path):
    with engine(model_path) as e:
        weights = new_weights(e, seed=6)
        e.update_weights_from_tensor(weights[:2], commit=False)
        result = e.abort_weight_update()
        assert not result["success"] and "2 tensor(s)" in result["message"]
        with pytest.raises(WeightsIncompleteError):
            e.generate(None, GREEDY, PROMPTS[0])
        assert e.get_weight_version() == "0"
        assert e.update_weights_from_tensor(weights[:2])["success"]
        assert e.generate(None, GREEDY, PROMPTS[0])["meta_info"]["weight_version"] == "1"


def test_aborting_a_stage_that_wrote_nothing_changes_nothing(model_path):
    with engine(model_path) as e:
        assert e.abort_weight_update()["message"] == "no weight update is open: nothing to abort"
        with pytest.raises(ValueError, match="no weight update is open"):
            e.commit_weight_update()
        assert e.generate(None, GREEDY, PROMPTS[0])["meta_info"]["weight_version"] == "0"


def test_host_copy_keeps_weights_across_release(model_path):
    with engine(model_path, enable_weights_cpu_backup=True) as kept, \
            engine(model_path) as dropped:
        before = tokens(kept)
        for e in (kept, dropped):
            assert e.release_memory_occupation()["success"]
            assert e.resume_memory_occupation(["weights"])["success"]
            assert e.resume_memory_occupation(["kv_cache"])["success"]
        assert tokens(kept) == before
        with pytest.raises(WeightsIncompleteError):
            dropped.generate(None, GREEDY, PROMPTS[0])


def test_update_weight_version_relabels_without_changing_weights(model_path):
    with engine(model_path) as e:
        before = tokens(e)
        assert e.update_weight_version("rl-step-3")["success"]
        outs = e.generate(None, GREEDY, PROMPTS)
        assert [o["output_ids"] for o in outs] == before
        assert {o["meta_info"]["weight_version"] for o in outs} == {"rl-step-3"}
        with pytest.raises(ValueError, match="new_version"):
            e.update_weight_version("")


def test_sglang_positional_order():
    import inspect

    params = list(inspect.signature(Engine.generate).parameters)
    assert params[1:4] == ["prompt", "sampling_params", "input_ids"]
    params = inspect.signature(Engine.update_weights_from_tensor).parameters
    assert list(params)[1:4] == ["named_tensors", "load_format", "flush_cache"]
    assert params["weight_version"].kind is inspect.Parameter.KEYWORD_ONLY
    params = list(inspect.signature(Engine.update_weights_from_distributed).parameters)
    assert params[1:7] == ["names", "dtypes", "shapes", "group_name", "flush_cache",
                           "load_format"]
