"""Routing replay: make a Hugging Face MoE forward use the experts the rollout engine chose.

Route layout: `routes` [batch, seq, moe_layers, top_k], any int dtype, aligned with the
`input_ids` [batch, seq] of the forward. routes[b, p, l] holds the top_k expert ids chosen for
the token at position p of row b (that token fed as input) in the l-th MoE layer, MoE layers
counted in layer order with dense layers skipped (Qwen3-MoE's `mlp_only_layers` /
`decoder_sparse_step`), the ids in the router's order (descending probability, as torch.topk
returns them). A row of -1 means "no recorded route" (padding, or a sequence's last token, which
the engine never feeds): the model's own router decides there.

Under replay the experts are the given ids, while the gate weights come from the model's own
router, computed as transformers does (softmax over all experts in float32, gathered at the ids,
renormalized where the router renormalizes: Qwen3-MoE's `norm_topk_prob`, Mixtral always, then
cast to the dtype HF returns), so gradients still reach the router weights and replaying the
ids the model would choose itself gives bit-identical logits.

Supported: transformers 5's `Qwen3MoeForCausalLM` and `MixtralForCausalLM`, whose routers
return (logits, top-k weights, top-k ids); replay is a forward hook that rewrites that output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "MixtralTopKRouter")
# Mixtral casts the logits before its softmax, Qwen3-MoE passes dtype=float32 to it: on CUDA the
# two can differ in the last bit, and replay must match HF's bits.
_CAST_BEFORE_SOFTMAX = ("MixtralTopKRouter",)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, one per MoE layer, in layer order."""
    routers = [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router "
                         f"({' or '.join(ROUTER_CLASSES)}): routing replay needs an MoE model")
    return routers


@contextmanager
def replay_routes(model: nn.Module, routes: torch.Tensor, stats: dict[str, int] | None = None
                  ) -> Iterator[None]:
    """Inside the block, every forward of `model` routes its tokens to `routes` (see the module
    docstring). Meant for one forward (with or without grad); a second forward in the block
    replays the same routes, so its token count must match too. Hooks are removed on exit.
    `stats`, if given, gains "replayed" (recorded (token, layer) rows) and "differ" (those where
    the model's own router would have chosen another set of experts)."""
    routers = moe_routers(model)
    per_layer = _check_routes(torch.as_tensor(routes), routers)
    handles = [r.register_forward_hook(_replay_hook(ids, stats))
               for r, ids in zip(routers, per_layer)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def record_routes(model: nn.Module, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run one forward without grad and return the routes the routers used, [batch, seq,
    moe_layers, top_k] int64 (inside `replay_routes`: the replayed ones)."""
    routers = moe_routers(model)
    used: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda _r, _args, out: used.append(out[2]))
               for r in routers]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(used, dim=1).view(*input_ids.shape, len(routers), -1).to(torch.long)


def _check_routes(routes: torch.Tensor, routers: list[nn.Module]) -> list[torch.Tensor]:
    """Validate `routes` against the model; return each layer's ids, [batch * seq, top_k]."""
    if routes.dim() != 4 or routes.dtype not in _INT_DTYPES:
        raise ValueError(f"routes must be an int tensor [batch, seq, moe_layers, top_k], got "
                         f"{routes.dtype} of shape {tuple(routes.shape)}")
    top_k, num_experts = routers[0].top_k, routers[0].num_experts
    if routes.shape[2] != len(routers):
        raise ValueError(f"routes hold {routes.shape[2]} MoE layers, the model has "
                         f"{len(routers)}")
    if routes.shape[3] != top_k:
        raise ValueError(f"routes hold top_k={routes.shape[3]} experts per token, the model "
                         f"routes to {top_k}")
    routes = routes.to(torch.long)
    missing = routes == -1
    if (missing.any(-1) & ~missing.all(-1)).any():
        raise ValueError("a route row mixes -1 with expert ids: a row is all -1 or top_k ids")
    bad = ~missing & ((routes < 0) | (routes >= num_experts))
    if bad.any():
        raise ValueError(f"expert id {routes[bad][0].item()} outside [0, {num_experts})")
    return list(routes.flatten(0, 1).unbind(1))


def _replay_hook(ids: torch.Tensor, stats: dict[str, int] | None) -> Callable:
    """A router forward hook that swaps the top-k ids for `ids` [tokens, top_k] where recorded
    and recomputes their weights from the router's own logits."""
    def hook(router: nn.Module, _args: tuple, output: tuple) -> tuple:
        logits, weights, chosen = output
        if chosen.shape[0] != ids.shape[0]:
            raise ValueError(f"the forward routes {chosen.shape[0]} tokens, routes hold "
                             f"{ids.shape[0]} (batch * seq)")
        given = ids.to(chosen.device)
        own = (given < 0).any(-1, keepdim=True)
        replayed = torch.where(own, chosen, given)
        if stats is not None:
            moved = (chosen.sort(-1).values != replayed.sort(-1).values).any(-1)
            stats["replayed"] = stats.get("replayed", 0) + int((~own).sum())
            stats["differ"] = stats.get("differ", 0) + int(moved.sum())
        if type(router).__name__ in _CAST_BEFORE_SOFTMAX:
            probs = torch.softmax(logits.float(), dim=-1)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        gate = probs.gather(-1, replayed)
        if getattr(router, "norm_topk_prob", True):  # Mixtral has no flag: always renormalizes
            gate = gate / gate.sum(dim=-1, keepdim=True)
        return logits, torch.where(own, weights, gate.to(weights.dtype)), replayed
    return hook
