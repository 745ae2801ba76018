"""The weight-update transaction's lifecycle edges (engine/weights/transaction.py): abort after a
partial receive, commit twice, a second open while one is open, and an update left open past
weight_update_timeout_s. The reference is the serving weights before the update (nothing
changed) or a fresh engine given the same tensors in one call."""

from __future__ import annotations

import threading

import pytest
import torch
from fixtures import serve, wait_until, write_tiny_chat_model

from hotswap.engine import Engine, RemoteEngine
from hotswap.engine.errors import WeightsIncompleteError
from hotswap.engine.weights.transaction import WeightUpdate
from hotswap.weight_sync import WeightSender
from hotswap.weight_sync.group import free_port

pytestmark = pytest.mark.slow
PROMPT = [5, 9, 33, 40, 7]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
NAME = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("transaction")))


def engine(path: str, **kwargs) -> Engine:
    return Engine(path, max_total_tokens=2048, **kwargs)


def new_weights(e: Engine, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(name, slot.view.detach().clone() + 0.05 * torch.randn(slot.view.shape,
                                                                   generator=gen))
            for name, slot in e.runner.weight_map.items()]


def tokens(e: Engine) -> list[int]:
    return e.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


def test_abort_after_a_partial_prepare_changes_nothing(model_path):
    with engine(model_path) as e:
        before, values = tokens(e), e.get_weights_by_name(NAME)
        assert e.prepare_weights_from_tensor(new_weights(e, 1)[:3])["success"]
        result = e.abort_weight_update()
        assert result["success"] and "nothing was written" in result["message"]
        assert e.weights.open_update is None and not e.scheduler.paused
        assert e.get_weight_version() == "0" and e.get_weights_by_name(NAME) == values
        assert tokens(e) == before


def test_abort_after_pieces_written_in_place_refuses_generation_until_complete(model_path):
    with engine(model_path) as e:
        weights = new_weights(e, 2)
        e.update_weights_from_tensor(weights[:2], commit=False)
        result = e.abort_weight_update()
        assert not result["success"] and "2 tensor(s) written in place" in result["message"]
        with pytest.raises(WeightsIncompleteError, match="aborted"):
            e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert e.update_weights_from_tensor(weights[:2])["success"]
        assert e.generate(input_ids=PROMPT, sampling_params=GREEDY)["meta_info"][
            "weight_version"] == "1"


def test_a_sender_gone_mid_prepare_leaves_nothing_open(model_path):
    """The broadcast of a prepare stops half-way: the receive fails, nothing is open or
    written, and the engine serves its old weights."""
    with engine(model_path, weight_update_timeout_s=5) as e:
        before = tokens(e)
        weights = new_weights(e, 3)
        sender = WeightSender("127.0.0.1", free_port(), world_size=2, backend="gloo",
                              timeout_s=30)
        try:
            sender.connect([e], weights[0][1].device)
            names = [n for n, _ in weights]
            dtypes = ["float32"] * len(weights)
            shapes = [list(t.shape) for _, t in weights]
            # Only the first tensor of the announced update is ever sent; the group times out.
            errors: list[BaseException] = []

            def prepare() -> None:
                try:
                    e.prepare_weights_from_distributed(names, dtypes, shapes,
                                                       sender.group_name)
                except BaseException as exc:  # noqa: BLE001 - checked below
                    errors.append(exc)

            worker = threading.Thread(target=prepare)
            worker.start()
            sender.group.broadcast(weights[0][1].contiguous())
            worker.join(timeout=60)
            assert not worker.is_alive() and errors, "the half-sent prepare did not fail"
        finally:
            sender.group.destroy()
        assert e.weights.open_update is None and e.get_weight_version() == "0"
        assert tokens(e) == before


def test_commit_twice_is_refused_and_changes_nothing(model_path):
    with engine(model_path) as e, engine(model_path) as reference:
        weights = new_weights(e, 4)
        reference.update_weights_from_tensor(weights)
        e.prepare_weights_from_tensor(weights)
        assert e.commit_weight_update("step-1")["weight_version"] == "step-1"
        with pytest.raises(ValueError, match="no weight update is open"):
            e.commit_weight_update("step-2")
        assert e.get_weight_version() == "step-1"
        assert tokens(e) == tokens(reference)


def test_a_second_open_while_one_is_open_is_refused(model_path):
    with engine(model_path) as e, engine(model_path) as reference:
        first, second = new_weights(e, 5), new_weights(e, 6)
        reference.update_weights_from_tensor(first)
        assert e.prepare_weights_from_tensor(first)["success"]
        for call in (lambda: e.prepare_weights_from_tensor(second),
                     lambda: e.update_weights_from_tensor(second),
                     lambda: e.update_weights_from_tensor(second, commit=False),
                     lambda: e.prepare_weights_from_disk(model_path)):
            with pytest.raises(ValueError, match="a weight update is open"):
                call()
        assert tokens(e) != tokens(reference)  # still serving the old weights meanwhile
        assert e.commit_weight_update()["weight_version"] == "1"
        assert tokens(e) == tokens(reference)  # the first update, untouched by the refusals

        # pieces in place hold generation; a prepare is refused, more pieces join
        e.update_weights_from_tensor(second[:2], commit=False)
        with pytest.raises(ValueError, match="a weight update is open"):
            e.prepare_weights_from_tensor(second)
        with pytest.raises(ValueError, match="paused generation with 'retract'"):
            e.commit_weight_update(pause_mode="abort")
        e.update_weights_from_tensor(second[2:], commit=False)
        result = e.commit_weight_update()
        assert result["weight_version"] == "2" and "2 piece(s)" in result["message"]


def test_one_error_rule_for_calls_that_meet_an_open_update_or_none(model_path):
    """docs/api.md#errors: a call refused before anything changed raises ValueError (HTTP 400,
    ValueError again from RemoteEngine); aborting with nothing open is done already."""
    with engine(model_path) as e, serve(e) as server:
        remote = RemoteEngine(server.url)
        assert e.prepare_weights_from_tensor(new_weights(e, 8))["success"]
        for client in (e, remote):
            for call in (lambda c: c.update_weight_version("relabelled"),
                         lambda c: c.release_memory_occupation(),
                         lambda c: c.update_weights_from_disk(model_path)):
                with pytest.raises(ValueError, match="a weight update is open"):
                    call(client)
        assert e.get_weight_version() == "0" and e.weights.open_update is not None
        assert remote.abort_weight_update()["success"]
        for client in (e, remote):
            with pytest.raises(ValueError, match="no weight update is open"):
                client.commit_weight_update()
            result = client.abort_weight_update()
            assert result["success"] and "nothing to abort" in result["message"]
        assert remote.update_weight_version("relabelled")["success"]


def test_a_pause_during_an_update_is_recorded_on_the_scheduler_thread(model_path):
    """The user's pause outlives an update open when it came; the mark is written by the
    scheduler thread, the only writer of what the transaction holds."""
    writers = []

    class Watched(WeightUpdate):
        def __setattr__(self, name, value):
            if name == "was_paused" and value:
                writers.append(threading.current_thread())
            super().__setattr__(name, value)

    with engine(model_path) as e:
        e.update_weights_from_tensor(new_weights(e, 9)[:2], commit=False)
        e.weights.open_update.__class__ = Watched
        assert e.pause_generation("retract")["success"]
        assert writers == [e.scheduler._thread]
        assert e.commit_weight_update()["success"]
        assert e.scheduler.paused  # the commit restored the user's pause, not lifted it
        e.continue_generation()
        assert not e.scheduler.paused


def test_an_update_left_open_is_aborted_after_the_timeout(model_path):
    with engine(model_path, weight_update_timeout_s=0.5) as e:
        before = tokens(e)
        e.prepare_weights_from_disk(model_path)
        assert wait_until(lambda: e.weights.open_update is None, timeout_s=10)
        with pytest.raises(ValueError, match="no weight update is open"):
            e.commit_weight_update()
        assert e.weights.standby.acquire()  # nothing holds the standby any more
        e.weights.standby.release()
        assert e.get_weight_version() == "0" and tokens(e) == before

        e.update_weights_from_tensor(new_weights(e, 7)[:2], commit=False)
        assert wait_until(lambda: e.weights.open_update is None, timeout_s=10)
        assert not e.scheduler.paused
        with pytest.raises(WeightsIncompleteError, match="left open"):
            e.generate(input_ids=PROMPT, sampling_params=GREEDY)


def test_adapter_updates_refuse_the_base_update_arguments(model_path):
    with engine(model_path) as e:
        for kwargs in ({"weight_version": "v"}, {"commit": False}, {"flush_cache": False},
                       {"staging": "standby"}):
            with pytest.raises(ValueError, match="not for an adapter update"):
                e.update_weights_from_distributed(["x"], ["float32"], [[4, 64]], "g",
                                                  lora_name="a", **kwargs)
        sender = WeightSender("127.0.0.1", free_port(), world_size=2, backend="gloo")
        with pytest.raises(ValueError, match="not for an adapter update"):
            sender.send([("x", torch.zeros(4, 64))], [e], weight_version="v", lora_name="a")
        assert not sender.connected  # refused before any group was made
        assert e.get_weight_version() == "0"
