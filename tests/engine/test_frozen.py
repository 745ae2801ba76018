"""Model names and frozen models (docs/api.md#model-names-and-frozen-models): a frozen engine (a
reward model or judge) refuses every update that does not name it, before anything changes,
and keeps serving; requests and updates naming another model are refused."""

from __future__ import annotations

import httpx
import pytest
from fixtures import serve, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine, RemoteEngine
from hotswap.engine.server.app import build_parser, engine_kwargs

KW = {"device": "cpu", "dtype": "float32", "max_total_tokens": 2048}
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPT = [5, 9, 14, 3, 7]
FROZEN = "this engine serves frozen model 'rm'; an update must pass model='rm'"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen")
    return {"a": write_tiny_chat_model(str(root / "a"), seed=0),
            "b": write_tiny_chat_model(str(root / "b"), seed=1)}


def _refusals(engine, paths) -> dict:
    """Every update route, unnamed: each must be refused."""
    b = load_file(f"{paths['b']}/model.safetensors")
    return {
        "tensor": lambda **m: engine.update_weights_from_tensor(b, **m),
        "serialized": lambda **m: engine.update_weights_from_serialized(["unused"], **m),
        "disk": lambda **m: engine.update_weights_from_disk(paths["b"], **m),
        "staged": lambda **m: engine.update_weights_from_disk(paths["b"], commit=False, **m),
        "prepare_disk": lambda **m: engine.prepare_weights_from_disk(paths["b"], **m),
        "prepare_tensor": lambda **m: engine.prepare_weights_from_tensor(b, **m),
        "relabel": lambda **m: engine.update_weight_version("x", **m),
        "distributed": lambda **m: engine.update_weights_from_distributed(
            ["model.norm.weight"], ["float32"], [[64]], group_name="none", **m),
        "prepare_distributed": lambda **m: engine.prepare_weights_from_distributed(
            ["model.norm.weight"], ["float32"], [[64]], group_name="none", **m),
    }


def test_a_frozen_engine_takes_only_updates_that_name_it(paths):
    with Engine(paths["a"], served_model_name="rm", frozen=True, **KW) as engine:
        assert engine.model_name == "rm"
        before = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
        version = engine.get_weight_version()
        for name, update in _refusals(engine, paths).items():
            with pytest.raises(ValueError, match=FROZEN):
                update()
            with pytest.raises(ValueError, match="for model 'policy'; this engine serves 'rm'"):
                update(model="policy")
            assert engine.get_weight_version() == version, name
            assert engine.weights.open_update is None, name
        assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == before
        engine.check_integrity()

        done = engine.update_weights_from_disk(paths["b"], weight_version="rm-2", model="rm")
        assert done["success"] and engine.get_weight_version() == "rm-2"
        assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] != before
        assert engine.update_weight_version("rm-3", model="rm")["success"]


def test_requests_naming_another_model_are_refused(paths):
    with Engine(paths["a"], **KW) as engine:
        assert engine.model_name == "a"  # the folder's name
        want = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
        got = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, model="a")
        assert got["output_ids"] == want
        with pytest.raises(ValueError, match="model 'rm': this engine serves 'a'"):
            engine.generate(input_ids=PROMPT, sampling_params=GREEDY, model="rm")
        with pytest.raises(ValueError, match="model 'rm'"):
            engine.classify(input_ids=PROMPT, model="rm")
        # Not frozen: an unnamed update is the policy's, a named one must name it.
        b = load_file(f"{paths['b']}/model.safetensors")
        with pytest.raises(ValueError, match="for model 'rm'"):
            engine.update_weights_from_tensor(b, model="rm")
        assert engine.update_weights_from_tensor(b, model="a")["success"]
        assert engine.update_weights_from_tensor(b, weight_version="v2")["success"]
    with pytest.raises(ValueError, match="served_model_name"):
        Engine(paths["a"], served_model_name="a:b", **KW)


def test_served_model_name_and_frozen_flags_over_http(paths):
    args = build_parser().parse_args(["--model-path", paths["a"], "--served-model-name", "rm",
                                      "--frozen", "--device", "cpu", "--dtype", "float32",
                                      "--max-total-tokens", "2048"])
    with Engine(**engine_kwargs(args)) as engine, serve(engine) as server:
        remote = RemoteEngine(server.url)
        assert (remote.model_name, remote.frozen) == ("rm", True)
        version = remote.get_weight_version()
        b = load_file(f"{paths['b']}/model.safetensors")
        with pytest.raises(ValueError, match=FROZEN):
            remote.update_weights_from_tensor(b)
        with pytest.raises(ValueError, match=FROZEN):
            remote.update_weights_from_disk(paths["b"])
        with pytest.raises(ValueError, match=FROZEN):
            remote.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
        assert remote.get_weight_version() == version
        before = remote.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
        with pytest.raises(ValueError, match="this engine serves 'rm'"):
            remote.generate(input_ids=PROMPT, sampling_params=GREEDY, model="policy")
        assert remote.update_weights_from_tensor(b, model="rm")["success"]
        assert remote.get_weight_version() != version
        after = remote.generate(input_ids=PROMPT, sampling_params=GREEDY, model="rm")
        assert after["output_ids"] != before
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["rm"]
        remote.shutdown()
