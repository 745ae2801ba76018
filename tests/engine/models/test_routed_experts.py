"""Routed experts for routing replay (docs/moe.md), engine side: meta_info["routed_experts"] holds
one row per position the engine fed (prompt + completion - 1); replaying them in HF's forward
gives the engine's logprobs (fp32, 1e-5) with chunked prefill and n > 1; a cache hit returns the
ids of a miss; a retraction across a weight update keeps, per position, the routing that
produced the next token; TP=2 equals TP=1; HTTP carries them as base64; and replay removes the
logprob gap that a routing disagreement opens."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import transformers
from fixtures import serve, write_moe, write_tiny_chat_model
from safetensors.torch import load_file
from torchrun_sender import save_checkpoint

from hotswap.engine import Engine, RemoteEngine
from hotswap.rollout.routing_replay import record_routes, replay_routes

ARCHS = ["qwen3_moe", "mixtral"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 30], [40, 41, 5, 6, 7, 30]]
SAMPLE = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, "seed": 3}
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
ROUTER_SCALE = 0.03


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[tuple[str, str], str]:
    root = tmp_path_factory.mktemp("routed")
    return {(arch, key): write_moe(str(root / f"{arch}-{key}"), arch, seed)
            for arch in ARCHS for key, seed in (("a", 0), ("b", 1))}


def engine(path: str, **kwargs) -> Engine:
    kwargs.setdefault("enable_return_routed_experts", True)
    return Engine(path, device="cpu", dtype="float32", max_total_tokens=2048, **kwargs)


def hf_model(path: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def sequence_routes(routes: np.ndarray, length: int) -> torch.Tensor:
    """One sequence's routes as replay_routes takes them: [1, length, layers, k], the rows the
    engine never fed (its last token) -1."""
    out = torch.full((1, length, *routes.shape[1:]), -1, dtype=torch.long)
    out[0, : len(routes)] = torch.from_numpy(routes.astype(np.int64))
    return out


def hf_logprobs(model: transformers.PreTrainedModel, prompt: list[int], output: list[int],
                routes: np.ndarray | None = None) -> list[float]:
    """log p(output token) under HF's forward over prompt + output, replaying `routes` if given."""
    ids = prompt + output
    with torch.no_grad():
        if routes is None:
            logits = model(torch.tensor([ids])).logits[0]
        else:
            with replay_routes(model, sequence_routes(routes, len(ids))):
                logits = model(torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    return [logp[p - 1, ids[p]].item() for p in range(len(prompt), len(ids))]


def engine_logprobs(out: dict) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_the_returned_routes_in_hf_gives_the_engines_logprobs(moe, arch):
    path = moe[arch, "a"]
    model = hf_model(path)
    layers = sum(type(m).__name__.endswith("TopKRouter") for m in model.modules())
    with engine(path, chunked_prefill_size=4) as eng:  # prompts prefilled in chunks
        outs = eng.generate(input_ids=PROMPTS, sampling_params={**SAMPLE, "n": 2},
                            return_logprob=True, return_routed_experts=True)
    assert len(outs) == 2 * len(PROMPTS)
    worst = 0.0
    for i, out in enumerate(outs):
        prompt, output = PROMPTS[i // 2], out["output_ids"]
        routes = out["meta_info"]["routed_experts"]
        assert routes.dtype == np.int16
        assert routes.shape == (len(prompt) + len(output) - 1, layers, 2)
        replayed = hf_logprobs(model, prompt, output, routes)
        worst = max(worst, *(abs(a - b) for a, b in zip(replayed, engine_logprobs(out))))
    assert worst <= 1e-5, worst


def test_a_cache_hit_returns_the_routes_of_a_miss(moe):
    path = moe["qwen3_moe", "a"]
    with engine(path) as eng:
        miss = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY,
                            return_routed_experts=True)
        hit = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY,
                           return_routed_experts=True)
        # A different continuation of the same prefix hits the cache for the prompt only.
        other = eng.generate(input_ids=PROMPTS[0][:6] + [50, 51], sampling_params=GREEDY,
                             return_routed_experts=True)
        plain = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    with engine(path, enable_prefix_cache=False) as eng:
        cold = eng.generate(input_ids=[PROMPTS[0], PROMPTS[0][:6] + [50, 51]],
                            sampling_params=GREEDY, return_routed_experts=True)
    assert miss["meta_info"]["cached_tokens"] == 0
    assert hit["meta_info"]["cached_tokens"] >= len(PROMPTS[0]) - 1
    assert other["meta_info"]["cached_tokens"] >= 6
    assert hit["output_ids"] == miss["output_ids"] == cold[0]["output_ids"]
    assert np.array_equal(hit["meta_info"]["routed_experts"], miss["meta_info"]["routed_experts"])
    assert np.array_equal(miss["meta_info"]["routed_experts"],
                          cold[0]["meta_info"]["routed_experts"])
    assert np.array_equal(other["meta_info"]["routed_experts"],
                          cold[1]["meta_info"]["routed_experts"])
    assert "routed_experts" not in plain["meta_info"]  # only when asked


def test_a_retraction_across_an_update_keeps_the_routing_that_produced_each_token(moe):
    """Positions fed before the update keep weights a's routing; those fed after it (the
    recomputation included) have weights b's, as fresh engines on those weights compute them."""
    a, b = moe["qwen3_moe", "a"], moe["qwen3_moe", "b"]
    prompt, budget = PROMPTS[0], 200
    params = {**GREEDY, "max_new_tokens": budget}
    with engine(a) as eng:
        events = eng.generate(input_ids=prompt, sampling_params=params,
                              return_routed_experts=True, stream=True)
        first = next(events)  # the request is running
        eng.pause_generation("retract")
        assert eng.update_weights_from_disk(b, weight_version="b")["success"]
        eng.continue_generation()
        rest = list(events)
    meta = rest[-1]["meta_info"]
    output = [t for e in [first, *rest] for t in e["output_ids"]]  # events carry deltas
    assert len(output) == budget and meta["num_retractions"] == 1
    (span_a, span_b) = meta["weight_versions"]
    cut = span_a["end"]  # outputs [0, cut) came from a
    assert span_b["version"] == "b" and 0 < cut < budget
    routes = meta["routed_experts"]
    assert len(routes) == len(prompt) + budget - 1
    fed_under_a = len(prompt) + cut - 1  # the last token a sampled was fed under b
    with engine(a) as fresh:
        ref_a = fresh.generate(input_ids=prompt + output[: cut - 1],
                               sampling_params={**GREEDY, "max_new_tokens": 1},
                               return_routed_experts=True)["meta_info"]["routed_experts"]
    with engine(b) as fresh:
        ref_b = fresh.generate(input_ids=prompt + output[:-1],
                               sampling_params={**GREEDY, "max_new_tokens": 1},
                               return_routed_experts=True)["meta_info"]["routed_experts"]
    assert np.array_equal(routes[:fed_under_a], ref_a)
    assert np.array_equal(routes[fed_under_a:], ref_b[fed_under_a:])


@pytest.mark.slow
def test_tp2_returns_the_routes_of_tp1(moe):
    path = moe["mixtral", "a"]
    outs = {}
    for tp in (1, 2):
        with engine(path, tp_size=tp) as eng:
            outs[tp] = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY,
                                    return_routed_experts=True)
    for one, two in zip(outs[1], outs[2], strict=True):
        assert one["output_ids"] == two["output_ids"]
        assert np.array_equal(one["meta_info"]["routed_experts"],
                              two["meta_info"]["routed_experts"])


def test_http_carries_the_routes_as_base64(moe):
    with engine(moe["mixtral", "a"]) as eng, serve(eng) as server:
        local = eng.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY,
                             return_routed_experts=True)
        raw = httpx.post(f"{server.url}/generate", json={
            "input_ids": PROMPTS[0], "sampling_params": GREEDY,
            "return_routed_experts": True}, timeout=60).json()
        remote = RemoteEngine(server.url)
        try:
            got = remote.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY,
                                  return_routed_experts=True)
            streamed = list(remote.generate(input_ids=PROMPTS[0], sampling_params=GREEDY,
                                            return_routed_experts=True, stream=True))
        finally:
            remote.shutdown()
    wire = raw["meta_info"]["routed_experts"]
    assert wire["dtype"] == "int16" and wire["shape"] == list(local[0]["meta_info"][
        "routed_experts"].shape) and isinstance(wire["data"], str)
    for want, out in zip(local, got, strict=True):
        assert np.array_equal(out["meta_info"]["routed_experts"],
                              want["meta_info"]["routed_experts"])
    assert all("routed_experts" not in e["meta_info"] for e in streamed[:-1])
    assert np.array_equal(streamed[-1]["meta_info"]["routed_experts"],
                          local[0]["meta_info"]["routed_experts"])


def test_refusals(moe, tmp_path):
    with engine(moe["qwen3_moe", "a"], enable_return_routed_experts=False) as eng:
        with pytest.raises(ValueError, match="enable_return_routed_experts"):
            eng.generate(input_ids=PROMPTS[0], return_routed_experts=True)
        with pytest.raises(ValueError, match="must be a bool"):
            eng.generate(input_ids=PROMPTS[0], return_routed_experts="yes")
        assert eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        engine(write_tiny_chat_model(str(tmp_path / "dense")))
    with pytest.raises(ValueError, match="hierarchical"):
        engine(moe["qwen3_moe", "a"], enable_hierarchical_cache=True)


def test_replay_removes_the_gap_a_routing_disagreement_opens(moe, tmp_path):
    """Routers with near-ties (their weights scaled down: close logits, as when many experts
    suit a token), and the engine's routers off the trainer's by noise of 1e-3 of their scale:
    some tokens go to other experts. Without replay the trainer's logprobs then differ from the
    engine's far more than with it."""
    src = moe["qwen3_moe", "a"]
    tensors = load_file(f"{src}/model.safetensors")
    routers = [n for n in tensors if n.endswith("mlp.gate.weight")]
    path = save_checkpoint({**tensors, **{n: ROUTER_SCALE * tensors[n] for n in routers}}, src,
                           str(tmp_path / "near-ties"))
    model = hf_model(path)
    gen = torch.Generator().manual_seed(0)
    noisy = [(n, ROUTER_SCALE * tensors[n] * (1 + 1e-3 * torch.randn(tensors[n].shape,
                                                                     generator=gen)))
             for n in routers]
    prompts = [[(7 * i + j) % 200 + 3 for j in range(12)] for i in range(8)]
    with engine(path) as eng:
        assert eng.update_weights_from_tensor(noisy, weight_version="noisy")["success"]
        outs = eng.generate(input_ids=prompts, sampling_params={**SAMPLE, "max_new_tokens": 24},
                            return_logprob=True, return_routed_experts=True)
    differ = rows = 0
    gap: dict[str, list[float]] = {"own": [], "replay": []}
    for prompt, out in zip(prompts, outs, strict=True):
        ids, routes = prompt + out["output_ids"], out["meta_info"]["routed_experts"]
        own = record_routes(model, torch.tensor([ids]))[0, : len(routes)].sort(-1).values
        given = torch.from_numpy(routes.astype(np.int64)).sort(-1).values
        differ += int((own != given).any(-1).sum())
        rows += own.shape[0] * own.shape[1]
        lps = engine_logprobs(out)
        for key, replay in (("own", None), ("replay", routes)):
            got = hf_logprobs(model, prompt, out["output_ids"], replay)
            gap[key] += [abs(a - b) for a, b in zip(got, lps, strict=True)]
    fraction = differ / rows
    own_gap, replay_gap = np.mean(gap["own"]), np.mean(gap["replay"])
    print(f"routes differing: {fraction:.2%} of (token, layer); mean |dlogp| without replay "
          f"{own_gap:.2e}, with replay {replay_gap:.2e} ({own_gap / replay_gap:.0f}x less)")
    assert fraction > 0  # the noise did move some tokens to other experts
    assert replay_gap * 5 <= own_gap
