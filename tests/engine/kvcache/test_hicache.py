"""HiCache: host and storage tiers beneath the device KV pool change reuse, never outputs."""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from hotswap.engine import Engine

PROMPT_LEN = 130  # matchable prefix 129 tokens: two whole 64-token storage blocks
GREEDY = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
POOL_ONE = 200  # a device pool that holds one long prefix (and the running request)
PATH_TOKENS = PROMPT_LEN + GREEDY["max_new_tokens"] - 1  # KV a finished request leaves cached


def long_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(PROMPT_LEN)] for _ in range(count)]


def run(engine: Engine, prompts: list[list[int]], params: dict = GREEDY) -> list[dict]:
    """One request at a time, as a cycle of long prompts arrives."""
    return [engine.generate(input_ids=p, sampling_params=params, return_logprob=True)
            for p in prompts]


def details(out: dict) -> dict:
    return out["meta_info"]["cached_tokens_details"]


def assert_same_outputs(outs: list[dict], ref: list[dict]) -> None:
    for out, want in zip(outs, ref):
        assert out["output_ids"] == want["output_ids"]
        got = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
        exp = [lp for lp, _ in want["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(exp, abs=1e-4)


@pytest.fixture(scope="module")
def cold(tiny_chat_model_path) -> list[dict]:
    """Every prompt computed from nothing."""
    with Engine(tiny_chat_model_path, max_total_tokens=4096, enable_prefix_cache=False) as eng:
        return run(eng, long_prompts(8))


def hicache_engine(path: str, host_paths: int, **kwargs) -> Engine:
    return Engine(path, max_total_tokens=POOL_ONE, enable_hierarchical_cache=True,
                  hicache_host_tokens=host_paths * (PATH_TOKENS + 3), **kwargs)


def test_second_pass_hits_the_host_tier_with_cold_outputs(tiny_chat_model_path, cold):
    prompts = long_prompts(8)
    with hicache_engine(tiny_chat_model_path, host_paths=8) as eng:
        first = run(eng, prompts)
        computed_first = eng.scheduler.stats["prefill_tokens"]
        second = run(eng, prompts)
        computed_second = eng.scheduler.stats["prefill_tokens"] - computed_first
        eng.check_integrity()
    assert [o["meta_info"]["cached_tokens"] for o in first] == [0] * 8
    assert [details(o) for o in second] == [
        {"device": 0, "host": PROMPT_LEN - 1, "storage": 0}] * 8
    assert computed_second == 8  # only each prompt's last token
    assert_same_outputs(first, cold)
    assert_same_outputs(second, cold)
    # Without the host tier the same pool keeps one prefix and the cycle never hits.
    one = {"max_new_tokens": 1}
    with Engine(tiny_chat_model_path, max_total_tokens=POOL_ONE) as eng:
        run(eng, prompts, one)
        assert [o["meta_info"]["cached_tokens"] for o in run(eng, prompts, one)] == [0] * 8


def test_host_tier_evicts_least_recently_used(tiny_chat_model_path, cold):
    prompts = long_prompts(8)
    with hicache_engine(tiny_chat_model_path, host_paths=4) as eng:
        run(eng, prompts)  # the device keeps prompt 7; the host the four evicted last: 3..6
        oldest, recent = run(eng, [prompts[0], prompts[5]])
        eng.check_integrity()
    assert details(oldest) == {"device": 0, "host": 0, "storage": 0}
    assert details(recent) == {"device": 0, "host": PROMPT_LEN - 1, "storage": 0}
    assert_same_outputs([oldest, recent], [cold[0], cold[5]])


def test_loaded_prefix_is_shared_with_a_longer_prompt(tiny_chat_model_path):
    """A host hit that ends mid-prompt, then a device extension on top of it."""
    base = long_prompts(2)
    longer = base[0] + [7, 8, 9, 10, 11]
    with Engine(tiny_chat_model_path, max_total_tokens=4096, enable_prefix_cache=False) as eng:
        want = run(eng, [longer])[0]
    with hicache_engine(tiny_chat_model_path, host_paths=4) as eng:
        run(eng, base)  # base[0] goes to the host tier
        got = run(eng, [longer])[0]
        eng.check_integrity()
    assert details(got)["host"] == PROMPT_LEN
    assert_same_outputs([got], [want])


_WRITER = """
import json, sys
from hotswap.engine import Engine
path, store, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with Engine(path, max_total_tokens={pool}, enable_hierarchical_cache=True,
            hicache_host_tokens=1024, hicache_storage_dir=store) as eng:
    outs = [eng.generate(input_ids=p, sampling_params={greedy}) for p in prompts]
print(json.dumps([o["output_ids"] for o in outs]))
"""


@pytest.mark.slow
def test_two_processes_share_a_storage_hit(tiny_chat_model_path, tmp_path):
    store = str(tmp_path / "kv")
    first, evicting = long_prompts(2, seed=3)
    script = _WRITER.format(pool=POOL_ONE, greedy=GREEDY)
    proc = subprocess.run([sys.executable, "-c", script, tiny_chat_model_path, store,
                           json.dumps([first, evicting])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    assert glob.glob(f"{store}/*/*.safetensors")  # the evicted prefix reached storage
    with Engine(tiny_chat_model_path, max_total_tokens=POOL_ONE, enable_hierarchical_cache=True,
                hicache_host_tokens=1024, hicache_storage_dir=store) as eng:
        out = eng.generate(input_ids=first, sampling_params=GREEDY)
        computed = eng.scheduler.stats["prefill_tokens"]
        eng.check_integrity()
    assert details(out) == {"device": 0, "host": 0, "storage": 128}
    assert computed == PROMPT_LEN - 128
    assert out["output_ids"] == written[0]
    assert not glob.glob(f"{store}/**/*.tmp", recursive=True)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_write_through_reaches_storage_before_any_eviction(tiny_chat_model_path, tmp_path,
                                                          policy):
    """A device pool with room for everything never evicts: write-back leaves storage empty,
    write-through writes the finished request's prefix, which a second engine on the same
    weights then loads instead of computing."""
    store = str(tmp_path / "kv")
    prompt = long_prompts(1, seed=17)[0]
    with Engine(tiny_chat_model_path, max_total_tokens=4096, enable_hierarchical_cache=True,
                hicache_storage_dir=store, hicache_write_policy=policy) as eng:
        want = run(eng, [prompt])
        stats = dict(eng.scheduler.tree.stats)
        assert eng.scheduler.tree.evictable_size() >= PATH_TOKENS  # still on the device
        eng.check_integrity()
    with Engine(tiny_chat_model_path, max_total_tokens=4096, enable_hierarchical_cache=True,
                hicache_storage_dir=store) as reader:
        got = run(reader, [prompt])
    if policy == "write_back":
        assert stats["storage_write_tokens"] == stats["host_backup_tokens"] == 0
        assert details(got[0]) == {"device": 0, "host": 0, "storage": 0}
    else:
        assert stats["host_backup_tokens"] == PATH_TOKENS
        assert stats["storage_write_tokens"] == 128  # two whole 64-token blocks
        assert details(got[0]) == {"device": 0, "host": 0, "storage": 128}
    assert_same_outputs(got, want)


def _perturbed(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.self_attn.v_proj.weight"
    return {name: weights[name] + 0.05}


def test_weight_update_retires_every_tier(tiny_chat_model_path, tmp_path):
    store = str(tmp_path / "kv")
    prompts = long_prompts(2, seed=5)
    update = _perturbed(tiny_chat_model_path)
    with hicache_engine(tiny_chat_model_path, host_paths=4, hicache_storage_dir=store) as eng:
        run(eng, prompts)  # prompts[0]: evicted to host and storage
        assert glob.glob(f"{store}/*/*.safetensors")
        eng.update_weights_from_tensor(update)
        assert not glob.glob(f"{store}/*/*.safetensors")  # the old namespace's files are gone
        after = run(eng, prompts)
        eng.check_integrity()
    with Engine(tiny_chat_model_path, max_total_tokens=4096) as fresh:
        fresh.update_weights_from_tensor(update)
        want = run(fresh, prompts)
    assert [o["meta_info"]["cached_tokens"] for o in after] == [0, 0]
    assert [details(o) for o in after] == [{"device": 0, "host": 0, "storage": 0}] * 2
    assert_same_outputs(after, want)


def test_storage_never_serves_other_weights_under_the_same_version(tiny_chat_model_path,
                                                                    tmp_path):
    """Two runs both call their weights version "0": the fingerprint in the key tells them
    apart, so a file written under one set of weights is never loaded under the other."""
    from conftest import write_tiny_chat_model

    store = str(tmp_path / "kv")
    other = write_tiny_chat_model(str(tmp_path / "other"), seed=1)
    prompts = long_prompts(2, seed=7)
    with hicache_engine(tiny_chat_model_path, host_paths=4, hicache_storage_dir=store) as eng:
        run(eng, prompts)
    assert glob.glob(f"{store}/*/*.safetensors")
    with Engine(other, max_total_tokens=4096, enable_prefix_cache=False) as ref:
        want = run(ref, prompts[:1])
    with hicache_engine(other, host_paths=4, hicache_storage_dir=store) as eng:
        got = run(eng, prompts[:1])
    with hicache_engine(tiny_chat_model_path, host_paths=4, hicache_storage_dir=store) as eng:
        same = run(eng, prompts[:1])  # the original weights still find their files
    assert details(got[0]) == {"device": 0, "host": 0, "storage": 0}
    assert_same_outputs(got, want)
    assert details(same[0])["storage"] == 128


@pytest.mark.slow
def test_integrity_and_outputs_under_pressure(tiny_chat_model_path):
    """Concurrent requests over shared prefixes: evictions, retractions, host loads and LRU on
    a host tier smaller than the working set; outputs as with a large pool, pools conserved."""
    rng = random.Random(11)
    prefixes = long_prompts(5, seed=13)
    prompts = [prefixes[rng.randrange(5)][:rng.randrange(60, PROMPT_LEN)]
               + [rng.randrange(3, 49152) for _ in range(rng.randrange(4, 20))]
               for _ in range(14)]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_chat_model_path, max_total_tokens=8192) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    with Engine(tiny_chat_model_path, max_total_tokens=420, enable_hierarchical_cache=True,
                hicache_host_tokens=400, max_running_requests=4, chunked_prefill_size=48) as eng:
        outs = []
        for _ in range(2):
            outs += eng.generate(input_ids=prompts, sampling_params=params)
            eng.check_integrity()
        stats = dict(eng.scheduler.tree.stats)
    assert [o["output_ids"] for o in outs] == want + want
    assert sum(details(o)["host"] for o in outs) > 0
    assert stats["host_backup_tokens"] > 400  # the host tier itself evicted (LRU)


def test_hicache_options_are_validated(tiny_chat_model_path, tmp_path):
    with pytest.raises(ValueError, match="hicache_host_tokens"):
        Engine(tiny_chat_model_path, hicache_host_tokens=1024)
    with pytest.raises(ValueError, match="hicache_storage_dir"):
        Engine(tiny_chat_model_path, hicache_storage_dir=str(tmp_path))
    with pytest.raises(ValueError, match="enable_hierarchical_cache"):
        Engine(tiny_chat_model_path, enable_hierarchical_cache=True, enable_prefix_cache=False)
    with pytest.raises(ValueError, match="hicache_host_tokens"):
        Engine(tiny_chat_model_path, enable_hierarchical_cache=True, hicache_host_tokens=0)
    with pytest.raises(ValueError, match="hicache_write_policy needs"):
        Engine(tiny_chat_model_path, hicache_write_policy="write_through")
    with pytest.raises(ValueError, match="'write_back' or 'write_through'"):
        Engine(tiny_chat_model_path, enable_hierarchical_cache=True,
               hicache_write_policy="write_around")


def test_server_flags_reach_the_engine():
    from hotswap.engine.server.app import build_parser, engine_kwargs

    args = build_parser().parse_args(["--model-path", "m", "--enable-hierarchical-cache",
                                      "--hicache-host-tokens", "4096",
                                      "--hicache-storage-dir", "/tmp/kv",
                                      "--hicache-write-policy", "write_through"])
    kwargs = engine_kwargs(args)
    assert kwargs["hicache_write_policy"] == "write_through"
    assert kwargs["enable_hierarchical_cache"] is True
    assert (kwargs["hicache_host_tokens"], kwargs["hicache_storage_dir"]) == (4096, "/tmp/kv")
    assert engine_kwargs(build_parser().parse_args(["--model-path", "m"]))[
        "enable_hierarchical_cache"] is False
