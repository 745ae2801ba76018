"""Routing replay on HF Qwen3-MoE and Mixtral: replaying a model's own routes is bit-identical,
replaying old routes on perturbed routers forces those experts and keeps router gradients,
-1 rows fall back to the router, bad routes are refused, and the model is untouched after."""

from __future__ import annotations

import pytest
import torch
import transformers
from fixtures import hf_moe

from hotswap.rollout.routing_replay import moe_routers, record_routes, replay_routes

ARCHS = ["qwen3_moe", "mixtral"]
VOCAB = 128
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
                    [40, 41, 5, 6, 7, 30, 90, 100, 3, 4, 70, 71]])


def tiny_moe(arch: str, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """Qwen3-MoE (layer 1 dense, norm_topk_prob on) or Mixtral, random."""
    return hf_moe(arch, VOCAB, seed=0).to(dtype).eval()


def logits(model: transformers.PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_own_routes_is_bit_identical(arch: str, dtype: torch.dtype) -> None:
    model = tiny_moe(arch, dtype)
    routes = record_routes(model, IDS)
    assert routes.shape == (2, 12, 2, 2) and routes.dtype == torch.int64
    want = logits(model)
    with replay_routes(model, routes.to(torch.int32)):
        got = logits(model)
    assert torch.equal(got, want)
    with replay_routes(model, torch.full_like(routes, -1)):  # no recorded route: own choice
        assert torch.equal(logits(model), want)
    assert torch.equal(logits(model), want)  # hooks gone after the block


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_forces_old_routes_on_perturbed_routers(arch: str) -> None:
    model = tiny_moe(arch)
    routes = record_routes(model, IDS)
    want = logits(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(torch.randn_like(router.weight) * 1e-2)
    drifted = record_routes(model, IDS)
    assert not torch.equal(drifted, routes)  # the perturbation flips some routes
    free = logits(model)

    with replay_routes(model, routes):
        assert torch.equal(record_routes(model, IDS), routes)
        replayed = logits(model)
        loss = model(input_ids=IDS, labels=IDS, use_cache=False).loss
        loss.backward()
    assert (replayed - want).abs().max() < (free - want).abs().max()
    for router in moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0

    partial = routes.clone()
    partial[1, 6:] = -1  # padding: the perturbed router's own choice there
    with replay_routes(model, partial):
        used = record_routes(model, IDS)
    assert torch.equal(used[0], routes[0]) and torch.equal(used[1, :6], routes[1, :6])
    # The first MoE layer's input does not depend on routes: there the own choice is drifted's.
    assert torch.equal(used[1, 6:, 0], drifted[1, 6:, 0])


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_routes_raise(arch: str) -> None:
    model = tiny_moe(arch)
    routes = record_routes(model, IDS)
    experts = moe_routers(model)[0].num_experts
    out_of_range = routes.clone()
    out_of_range[0, 3, 1, 0] = experts
    mixed = routes.clone()
    mixed[0, 3, 1, 0] = -1
    cases = [(routes[:, :, :1], "MoE layers"), (routes[..., :1], "top_k"),
             (out_of_range, "outside"), (mixed, "mixes -1"), (routes.float(), "int tensor")]
    for bad, words in cases:
        with pytest.raises(ValueError, match=words), replay_routes(model, bad):
            pass
    with pytest.raises(ValueError, match="tokens"), replay_routes(model, routes[:, :5]):
        logits(model)
    assert torch.equal(record_routes(model, IDS), routes)  # hooks removed after the error
