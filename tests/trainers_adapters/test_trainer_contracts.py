"""Contract tests: slime's and verl's (its SGLang rollout, over HTTP) call sequences replayed
against hotswap running in another process, with the argument names as written in their source,
over gloo. (verl 0.9's rollout registration: test_verl.py; OpenRLHF: test_openrlhf_actor.py.)

- slime 624b824 (backends/sglang_utils/sglang_engine.py, megatron_utils/update_weight/
  update_weight_from_distributed.py, rollout/sglang_rollout.py): HTTP server.
- verl b178a3c (workers/rollout/sglang_rollout/{sglang_rollout,http_server_engine}.py,
  workers/fsdp_workers.py): HTTP server.

What each side sees is checked against a reference: HF transformers' greedy tokens under the
weights the trainer pushed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import torch.distributed as dist
import transformers
from fixtures import hf_greedy, write_tiny_chat_model

from hotswap.trainers_adapters.groups import (
    destroy_process_group,
    init_custom_process_group,
)
from hotswap.weight_sync.group import free_port
from hotswap.weight_sync.serialize import serialize_named_tensors

pytestmark = pytest.mark.slow
PROMPT_IDS = [5, 9, 33, 40, 7, 12]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("contracts")))


@pytest.fixture(scope="module")
def hf_model(model_path):
    return transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def trained(hf_model, seed: int) -> dict[str, torch.Tensor]:
    """The trainer's weights after a step: every tensor moved."""
    gen = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen)
            for n, p in hf_model.state_dict().items()}


@pytest.fixture(scope="module")
def server(model_path):
    """`python -m hotswap.engine.server` in its own process."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hotswap.engine.server", "--model-path", model_path,
         "--port", str(port), "--device", "cpu", "--max-total-tokens", "2048",
         "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def post(url: str, endpoint: str, payload: dict | None = None) -> dict:
    """slime's SGLangEngine._make_request: POST json, raise for status, return the JSON."""
    response = httpx.post(f"{url}/{endpoint}", json=payload or {}, timeout=120)
    response.raise_for_status()
    return response.json()


def slime_generate(url: str, sampling_seed: int | None = None) -> dict:
    """slime/rollout/sglang_rollout.py generate(): its payload and the fields it reads."""
    sampling_params = dict(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=NEW_TOKENS,
                           stop=None, stop_token_ids=None, skip_special_tokens=False,
                           no_stop_trim=True, spaces_between_special_tokens=False)
    if sampling_seed is not None:
        sampling_params["sampling_seed"] = sampling_seed
    output = post(url, "generate", {"sampling_params": sampling_params, "return_logprob": True,
                                    "input_ids": PROMPT_IDS})
    items = output["meta_info"]["output_token_logprobs"]
    return {"tokens": [item[1] for item in items], "log_probs": [item[0] for item in items],
            "text": output["text"], "weight_version": output["meta_info"]["weight_version"]}


def test_slime_distributed_update_sequence(server, hf_model, model_path):
    url = server
    httpx.get(f"{url}/health_generate", timeout=60).raise_for_status()  # _wait_server_healthy
    assert slime_generate(url)["tokens"] == hf_greedy(model_path, PROMPT_IDS, NEW_TOKENS)
    seeded = slime_generate(url, sampling_seed=3)
    assert len(seeded["tokens"]) == NEW_TOKENS and isinstance(seeded["text"], str)

    # connect_rollout_engines_from_distributed: engine RPCs and the trainer's group at once.
    master_port, group_name = free_port(), "slime-pp_0"
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(post, url, "init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": master_port, "rank_offset": 1,
            "world_size": 2, "group_name": group_name, "backend": "gloo"})
        group = init_custom_process_group(backend="gloo",
                                          init_method=f"tcp://127.0.0.1:{master_port}",
                                          world_size=2, rank=0, group_name=group_name)
        assert ref.result()["success"]

    weights = trained(hf_model, seed=1)
    names = list(weights)
    buckets = [names[i:i + 4] for i in range(0, len(names), 4)]
    # UpdateWeightFromDistributed.update_weights: pause -> flush -> buckets -> continue.
    post(url, "pause_generation", {})
    assert httpx.get(f"{url}/flush_cache", timeout=60).status_code == 200
    version = "1"
    with ThreadPoolExecutor(1) as pool:
        for bucket in buckets:
            converted_named_tensors = [(n, weights[n]) for n in bucket]
            ref = pool.submit(post, url, "update_weights_from_distributed", {
                "names": [name for name, _ in converted_named_tensors],
                "dtypes": [str(p.dtype).replace("torch.", "") for _, p in converted_named_tensors],
                "shapes": [list(p.shape) for _, p in converted_named_tensors],
                "group_name": group_name, "flush_cache": False, "weight_version": version})
            handles = [dist.broadcast(param.data, 0, group=group, async_op=True)
                       for _, param in converted_named_tensors]
            for handle in handles:
                handle.wait()
            assert ref.result()["success"]
            # Between buckets nothing is served and the version has not moved.
            assert httpx.get(f"{url}/get_weight_version").json()["weight_version"] == "0"
    post(url, "continue_generation", {})
    assert httpx.get(f"{url}/get_weight_version").json()["weight_version"] == version
    after = slime_generate(url)
    assert after["weight_version"] == version
    assert after["tokens"] == hf_greedy(model_path, PROMPT_IDS, NEW_TOKENS, weights)

    # disconnect_rollout_engines_from_distributed
    assert post(url, "destroy_weights_update_group", {"group_name": group_name})["success"]
    destroy_process_group(group)


def test_verl_server_adapter_sequence(server, hf_model, model_path):
    url = server
    before = httpx.get(f"{url}/get_weight_version").json()["weight_version"]
    # ServerAdapter.release (sleep), then the worker's order: resume(weights) -> update ->
    # resume(kv_cache).
    post(url, "release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    post(url, "resume_memory_occupation", {"tags": ["weights"]})
    weights = trained(hf_model, seed=2)
    names = list(weights)
    for i in range(0, len(names), 5):
        bucket = {n: weights[n] for n in names[i:i + 5]}
        # AsyncHttpServerAdapter.update_weights_from_tensor: per bucket, flush_cache False.
        reply = post(url, "update_weights_from_tensor", {
            "serialized_named_tensors": [serialize_named_tensors(bucket)],
            "load_format": None, "flush_cache": False})
        assert reply["success"]
        if i == 0:  # released weights are half rewritten now: refused, never served
            refused = httpx.post(f"{url}/generate", json={"input_ids": PROMPT_IDS})
            assert refused.status_code == 503
    # flush_cache: verl polls GET /flush_cache until 200; here it commits the staged buckets.
    assert httpx.get(f"{url}/flush_cache", timeout=120).status_code == 200
    post(url, "resume_memory_occupation", {"tags": ["kv_cache"]})
    version = httpx.get(f"{url}/get_weight_version").json()["weight_version"]
    assert version == str(int(before) + 1)  # every bucket, one version
    out = post(url, "generate", {"input_ids": PROMPT_IDS, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": NEW_TOKENS}})
    assert out["output_ids"] == hf_greedy(model_path, PROMPT_IDS, NEW_TOKENS, weights)
    assert out["meta_info"]["weight_version"] == version
    # AsyncHttpServerAdapter.generate: `text` for the prompt, None fields filtered out, and the
    # agent loop reads (log_prob, token_id, _) triples.
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_model.name_or_path)
    payload = {"text": tokenizer.decode(PROMPT_IDS), "input_ids": None, "return_logprob": True,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}}
    payload = {k: v for k, v in payload.items() if v is not None}
    output = post(url, "generate", payload)
    log_probs, token_ids = zip(*[(lp, t) for lp, t, _ in
                                 output["meta_info"]["output_token_logprobs"]], strict=True)
    assert list(token_ids) == output["output_ids"] and all(lp <= 0 for lp in log_probs)
