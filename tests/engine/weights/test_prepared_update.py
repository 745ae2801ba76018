"""Two-phase weight updates on real engines: prepare / commit / abort, and a WeightSender with
several engines that commits on all of them or on none."""

from __future__ import annotations

import pytest
import torch
from fixtures import write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine
from hotswap.weight_sync import WeightSender, WeightSyncError
from hotswap.weight_sync.group import free_port

PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prepared")
    return {"a": write_tiny_chat_model(str(root / "a"), seed=0),
            "b": write_tiny_chat_model(str(root / "b"), seed=1),
            # same family, another MLP width: every update for the others is refused here
            "wide": write_tiny_chat_model(str(root / "wide"), seed=2, intermediate_size=192)}


def _engine(path: str) -> Engine:
    return Engine(path, device="cpu", max_total_tokens=2048)


def test_prepare_commit_and_abort(paths):
    with _engine(paths["a"]) as eng, _engine(paths["b"]) as fresh_b:
        want_a = eng.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
        want_b = fresh_b.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
        assert want_a != want_b
        reply = eng.prepare_weights_from_disk(paths["b"])
        assert reply["success"] and reply["weight_version"] == "1"
        # Prepared is not committed: the old weights and version keep serving.
        assert eng.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == want_a
        assert eng.get_weight_version() == "0"
        assert eng.abort_weight_update()["success"]
        with pytest.raises(ValueError, match="no weight update is open"):
            eng.commit_weight_update()
        eng.prepare_weights_from_disk(paths["b"])
        out = eng.commit_weight_update(weight_version="step-1")
        assert out["success"] and eng.get_weight_version() == "step-1"
        got = eng.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert got["output_ids"] == want_b and got["meta_info"]["weight_version"] == "step-1"
        with pytest.raises(ValueError, match="shape"):
            eng.prepare_weights_from_disk(paths["wide"])


def test_sender_commits_on_all_engines_or_none(paths):
    new = load_file(f"{paths['b']}/model.safetensors")
    with _engine(paths["a"]) as one, _engine(paths["a"]) as two, _engine(paths["wide"]) as odd:
        one.update_weights_from_disk(paths["a"])  # one is at "1", two at "0"
        before = odd.get_weights_by_name("model.layers.0.mlp.down_proj.weight")

        sender = WeightSender("127.0.0.1", free_port(), world_size=3, backend="gloo",
                              timeout_s=30)
        try:
            with pytest.raises(WeightSyncError, match="no target committed") as info:
                sender.send(new, [one, odd], weight_version="v1")
            assert list(info.value.failures) == [f"target 1 ({odd!r})"]
            assert one.get_weight_version() == "1" and odd.get_weight_version() == "0"
            assert one.weights.open_update is None and odd.weights.open_update is None
            assert odd.get_weights_by_name("model.layers.0.mlp.down_proj.weight") == before
            want = one.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
            assert want == two.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
        finally:
            sender.close([one, odd])

        sender = WeightSender("127.0.0.1", free_port(), world_size=3, backend="gloo",
                              timeout_s=30)
        try:
            replies = sender.send(new, [one, two])  # no version given: they agree on "2"
            assert [r["weight_version"] for r in replies] == ["2", "2"]
        finally:
            sender.close([one, two])
        with _engine(paths["b"]) as fresh:
            want = fresh.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
        for eng in (one, two):
            got = eng.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
            assert got["output_ids"] == want["output_ids"]
            assert got["meta_info"]["weight_version"] == "2"
            lp = torch.tensor([x[0] for x in got["meta_info"]["output_token_logprobs"]])
            ref = torch.tensor([x[0] for x in want["meta_info"]["output_token_logprobs"]])
            assert torch.allclose(lp, ref, atol=1e-5)
