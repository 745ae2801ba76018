"""OpenRLHF 0.11.2's rollout actor contract: hotswap's actors, made by `create_vllm_engines` in a
placement group on a local Ray, driven in the order OpenRLHF's trainer calls them.

The method list is checked against `RolloutRayActor` in OpenRLHF's installed source (read with
ast: it imports vLLM) when `pip install openrlhf==0.11.2 --no-deps` is there, else against the
signatures recorded below from that source. With OpenRLHF installed (plus aiohttp and
pylatexenc, which its agent module imports) `generate_responses` runs OpenRLHF's own
SingleTurnAgentExecutor. Served tokens are checked against HF transformers' greedy tokens
under the weights the trainer broadcast.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
import transformers
from fixtures import hf_greedy, write_tiny_chat_model

from hotswap.trainers_adapters import openrlhf
from hotswap.trainers_adapters.groups import stateless_init_process_group
from hotswap.trainers_adapters.vllm import SamplingParams
from hotswap.weight_sync.group import free_port

# RolloutRayActor's methods in openrlhf 0.11.2 trainer/ray/vllm_engine.py: (async, parameters)
RECORDED = {
    "init_process_group": (True, ["master_address", "master_port", "rank_offset", "world_size",
                                  "group_name", "backend", "use_ray"]),
    "update_weight": (True, ["name", "dtype", "shape", "empty_cache"]),
    "update_weight_cuda_ipc": (True, ["name", "dtype", "shape", "ipc_handles", "empty_cache"]),
    "reset_prefix_cache": (True, []),
    "pause_generation": (True, []),
    "resume_generation": (True, []),
    "sleep": (True, ["level"]),
    "wake_up": (True, ["tags"]),
    "generate": (True, ["prompt_token_ids", "sampling_params", "multi_modal_data"]),
    "get_num_unfinished_requests": (False, []),
    "generate_responses": (True, ["prompt", "label", "sampling_params", "max_length",
                                  "hf_tokenizer", "num_samples", "images"]),
}
CREATE_ARGS = ["num_engines", "tensor_parallel_size", "pretrain", "seed", "full_determinism",
               "enable_prefix_caching", "enforce_eager", "max_model_len", "shared_pg",
               "gpu_memory_utilization", "vllm_enable_sleep", "logprobs_mode", "agent_func_path",
               "remote_rm_url", "max_images_per_prompt"]
PROMPT = "The quick brown fox"
NEW_TOKENS = 6


def installed_source() -> dict[str, tuple[bool, list[str]]] | None:
    """RolloutRayActor's public methods and create_vllm_engines' arguments, from the source."""
    spec = importlib.util.find_spec("openrlhf")
    if spec is None:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "trainer/ray/vllm_engine.py"
    found: dict[str, tuple[bool, list[str]]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "RolloutRayActor":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and \
                        not fn.name.startswith("_"):
                    found[fn.name] = (isinstance(fn, ast.AsyncFunctionDef),
                                      [a.arg for a in fn.args.args[1:]])
        elif isinstance(node, ast.FunctionDef) and node.name == "create_vllm_engines":
            found["create_vllm_engines"] = (False, [a.arg for a in node.args.args])
    return found


def test_actor_has_openrlhf_methods():
    source = installed_source()
    expected = dict(RECORDED)
    if source is not None:
        assert source.pop("create_vllm_engines")[1] == CREATE_ARGS
        assert source == RECORDED, "OpenRLHF's RolloutRayActor changed: update RECORDED"
    for name, (is_async, params) in expected.items():
        method = getattr(openrlhf.HotswapRolloutActor, name)
        assert inspect.iscoroutinefunction(method) is is_async, name
        assert list(inspect.signature(method).parameters)[1:len(params) + 1] == params, name
    ours = list(inspect.signature(openrlhf.create_vllm_engines).parameters)
    assert ours[:len(CREATE_ARGS)] == CREATE_ARGS


def test_vllm_engine_arguments_are_mapped_or_refused():
    model, options, mode = openrlhf.engine_options(dict(
        model="m", tensor_parallel_size=2, seed=3, max_model_len=512, dtype="bfloat16",
        enable_prefix_caching=True, enable_sleep_mode=True, full_determinism=False,
        enforce_eager=True, gpu_memory_utilization=0.5, logprobs_mode="raw_logprobs",
        engine_kwargs={"max_total_tokens": 64}))
    assert (model, mode) == ("m", "raw")
    assert options == {"max_total_tokens": 64, "tp_size": 2, "seed": 3, "context_length": 512,
                       "dtype": "bfloat16", "enable_prefix_cache": True,
                       "enable_weights_cpu_backup": True, "deterministic": False}
    with pytest.raises(ValueError, match="speculative_config"):
        openrlhf.engine_options({"model": "m", "speculative_config": {}})
    with pytest.raises(ValueError, match="multi-modal"):
        openrlhf.engine_options({"model": "m", "limit_mm_per_prompt": {"image": 1}})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("openrlhf")))


@pytest.mark.slow
def test_openrlhf_call_order_on_ray(model_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False)
    try:
        replay_openrlhf(ray, model_path)
    finally:
        ray.shutdown()


def replay_openrlhf(ray, model_path: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    prompt_ids = tokenizer(text=PROMPT, add_special_tokens=False)["input_ids"]
    engines = openrlhf.create_vllm_engines(
        2, 1, model_path, seed=0, full_determinism=False, enable_prefix_caching=True,
        enforce_eager=True, max_model_len=256, vllm_enable_sleep=True, dtype="float32",
        engine_kwargs={"max_total_tokens": 2048})
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                            skip_special_tokens=False, logprobs=1)

    def generate_all() -> list[dict]:
        # SamplesGenerator._dispatch_prompts_to_vllm: loads first, then one call per prompt
        assert ray.get([e.get_num_unfinished_requests.remote() for e in engines]) == [0, 0]
        refs = [e.generate_responses.remote(prompt=PROMPT, label="x", sampling_params=greedy,
                                            max_length=64, hf_tokenizer=tokenizer, num_samples=2)
                for e in engines]
        return [r for rs in ray.get(refs) for r in rs]

    # generate_samples with vllm.enable_sleep: wake_up, generate, sleep
    ray.get([e.wake_up.remote() for e in engines])
    before = generate_all()
    ray.get([e.sleep.remote() for e in engines])
    reference = hf_greedy(model_path, prompt_ids, NEW_TOKENS)
    for response in before:
        assert response["observation_tokens"] == prompt_ids + reference
        assert response["action_ranges"] == [(len(prompt_ids), len(prompt_ids) + NEW_TOKENS)]
        assert len(response["rollout_log_probs"]) == len(prompt_ids) + NEW_TOKENS

    # PolicyModelActor._init_vllm_sync_group: engine i at rank_offset 1 + i, rank 0 the trainer
    address, port, world_size = "127.0.0.1", free_port(), 1 + len(engines)
    refs = [e.init_process_group.remote(address, port, i + 1, world_size, "openrlhf",
                                        backend="gloo", use_ray=False)
            for i, e in enumerate(engines)]
    group = stateless_init_process_group(address, port, 0, world_size, "cpu")
    ray.get(refs)

    # PPOTrainer.broadcast_to_vllm: wake the weights only, then the actor's broadcast_to_vllm
    ray.get([e.wake_up.remote(tags=["weights"]) for e in engines])
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    cache_reset_refs = [e.reset_prefix_cache.remote() for e in engines]
    params = list(model.named_parameters())
    for count, (name, param) in enumerate(params, start=1):
        refs = [e.update_weight.remote(name, dtype=param.dtype, shape=param.shape,
                                       empty_cache=count == len(params)) for e in engines]
        group.broadcast(param.data, src=0, stream=None)
        ray.get(refs)
        if count < len(params):  # staged: nothing moved yet
            assert ray.get([e.get_weight_version.remote() for e in engines]) == ["0", "0"]
    ray.get(cache_reset_refs)
    assert ray.get([e.get_weight_version.remote() for e in engines]) == ["1", "1"]

    # the async trainer pauses around a push; then the next rollout wakes the KV cache
    ray.get([e.pause_generation.remote() for e in engines])
    ray.get([e.resume_generation.remote() for e in engines])
    ray.get([e.wake_up.remote() for e in engines])
    after = generate_all()
    pushed = hf_greedy(model_path, prompt_ids, NEW_TOKENS,
                       {n: p.detach() for n, p in model.state_dict().items()})
    assert pushed != reference
    for response in after:
        assert response["observation_tokens"] == prompt_ids + pushed
        assert all(lp <= 0 for lp in response["rollout_log_probs"][len(prompt_ids):])
    out = ray.get(engines[0].generate.remote(prompt_ids, greedy))
    assert out.outputs[0].token_ids == pushed and out.outputs[0].weight_version == "1"
    with pytest.raises(ray.exceptions.RayTaskError, match="CUDA IPC"):
        ray.get(engines[0].update_weight_cuda_ipc.remote("x", torch.float32, [1], {}))
    group.destroy()
    ray.get([e.shutdown.remote() for e in engines])
