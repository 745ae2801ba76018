"""verl 0.9.1's rollout over hotswap, without verl installed: the server actor verl's replica
starts (server.py) and the training worker's BaseRollout (rollout.py) on a local Ray, called in
the order verl's hybrid sync trainer calls them: generate (agent loop), sleep (after sampling),
resume(["weights"]) -> update_weights(..., global_steps=) -> resume(["kv_cache"]) (the worker).
verl's own trainer runs them end to end in `make test-verl` (examples/verl/grpo_cpu.py)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
import transformers
from fixtures import hf_greedy, write_tiny_chat_model

from hotswap.rollout.client import versions_per_token as token_versions
from hotswap.trainers_adapters import verl as verl_adapter
from hotswap.trainers_adapters.verl.rollout import HotswapRollout
from hotswap.trainers_adapters.verl.server import HotswapServer, ServerSettings

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
IDS = [5, 9, 33, 40, 7, 12]
SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
            "logprobs": True, "max_tokens": 5}  # what verl's agent loop sends, plus a budget
CONFIG = {"tensor_model_parallel_size": 1, "free_cache_engine": True,
          "checkpoint_engine": {"update_weights_bucket_megabytes": 0}}  # a bucket per tensor


def test_registers_with_verl_only_when_installed():
    assert verl_adapter.register() is (importlib.util.find_spec("verl") is not None)


def test_token_versions_expand_the_engine_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5) == ["3", "3", "4", "4", "4"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("verl")))


@pytest.fixture(scope="module")
def server(model_path):
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False)
    settings = ServerSettings(model_path, {"device": "cpu", "dtype": "float32",
                                           "max_total_tokens": 2048})
    handle = ray.remote(HotswapServer).options(name="hotswap_server_0_0",
                                               max_concurrency=64).remote(settings)
    ray.get(handle.ready.remote())
    yield handle
    ray.get(handle.shutdown.remote())
    ray.shutdown()


def trained(model_path: str, seed: int) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen)
            for n, p in model.state_dict().items()}


def push(rollout: HotswapRollout, weights: dict, step: int, **kwargs) -> None:
    """ActorRolloutRefWorker.update_weights (mode "naive"): resume weights, push, resume KV."""
    async def flow() -> None:
        await rollout.resume(tags=["weights"])
        await rollout.update_weights(iter(weights.items()), peft_config=None,
                                     base_sync_done=True, global_steps=step, **kwargs)
        await rollout.resume(tags=["kv_cache"])
    asyncio.run(flow())


def test_hybrid_step_order_one_version_per_step(server, model_path):
    out = ray.get(server.generate.remote(IDS, dict(SAMPLING), "r0"))
    assert out.token_ids == hf_greedy(model_path, IDS, 5) and len(out.log_probs) == 5
    assert out.extra_fields["hotswap_weight_versions"] == ["0"] * 5
    assert out.stop_reason == "completed"

    rollout = HotswapRollout(CONFIG, model_config=None)  # RANK unset: replica 0, its leader
    assert (rollout.replica_rank, rollout.is_leader_rank) == (0, True)
    weights = trained(model_path, seed=1)
    for step in (0, 1):  # verl pushes at init (step 0), then after each step's update
        ray.get(server.sleep.remote())  # CheckpointEngineManager.sleep_replicas
        push(rollout, weights if step else trained(model_path, seed=0), step)
        assert ray.get(server.get_weight_version.remote()) == str(step)
    out = ray.get(server.generate.remote(IDS, dict(SAMPLING), "r1"))
    assert out.token_ids == hf_greedy(model_path, IDS, 5, weights)
    assert out.extra_fields["hotswap_weight_versions"] == ["1"] * 5
    assert [out.extra_fields[k] for k in ("global_steps", "min_global_steps",
                                          "max_global_steps")] == [1, 1, 1]


def test_push_is_refused_whole(server, model_path):
    rollout = HotswapRollout(CONFIG, model_config=None)
    before = ray.get(server.get_weight_version.remote())
    with pytest.raises(ValueError, match="delta"):
        push(rollout, {}, 7, wire_format="delta_flush")
    with pytest.raises(ValueError, match="LoRA"):
        asyncio.run(rollout.update_weights(iter([]), peft_config={"r": 8}))
    bad = trained(model_path, seed=2)
    bad["lm_head.weight" if "lm_head.weight" in bad else next(reversed(bad))] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="no replica moved"):
        push(rollout, bad, 8)
    assert ray.get(server.get_weight_version.remote()) == before  # no new version
    with pytest.raises(ray.exceptions.RayTaskError, match="incomplete|released|refus"):
        ray.get(server.generate.remote(IDS, dict(SAMPLING), "r2"))  # half written: refused
    good = trained(model_path, seed=3)
    push(rollout, good, 9)
    out = ray.get(server.generate.remote(IDS, dict(SAMPLING), "r3"))
    assert out.token_ids == hf_greedy(model_path, IDS, 5, good)
    assert out.extra_fields["global_steps"] == 9


def test_control_calls_verl_makes(server):
    long = {**SAMPLING, "max_tokens": 200, "ignore_eos": True}
    pending = server.generate.remote(IDS, long, "r4")
    ray.get(server.abort_all_requests.remote(reject_request=False))
    assert ray.get(pending).stop_reason == "aborted"
    ray.get(server.resume_generation.remote())
    assert len(ray.get(server.generate.remote(IDS, dict(SAMPLING), "r5")).token_ids) == 5
    ray.get([server.release_kv_cache.remote(), server.set_global_steps.remote(3)])
    ray.get(server.resume_kv_cache.remote())
    ray.get([server.clear_kv_cache.remote(), server.start_profile.remote(),
             server.stop_profile.remote()])
    host, port = ray.get(server.get_server_address.remote())
    assert host == "127.0.0.1" and port > 0
    with pytest.raises(ray.exceptions.RayTaskError, match="hybrid"):
        ray.get(server.wake_up.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="video"):
        ray.get(server.generate.remote(IDS, dict(SAMPLING), "r6", video_data=["x"]))
    with pytest.raises(ray.exceptions.RayTaskError, match="text-only model"):  # passed through
        ray.get(server.generate.remote(IDS, dict(SAMPLING), "r7", image_data=["x"]))
