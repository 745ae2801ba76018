"""The exact trainer forward (rollout/exact_forward.py): on rollouts of a deterministic=True
engine its logprobs are the engine's bit for bit (torch.equal) for every model family, float32
and bf16, padded, packed and GRPO-unit layouts, and temperatures 1 and 0.7; MoE routes are the
engine's; its gradients are HF's within 1e-5 (float32)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from conftest import write_tiny_model
from fixtures import write_moe, write_tokenizer

from hotswap.engine import Engine
from hotswap.engine.layers import cpu_kernels
from hotswap.rollout.exact_forward import (
    ExactForward,
    packed_sequences,
    padded_sequences,
    segment_sequences,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs the CPU kernels")

FAMILIES = ["llama", "llama3-rope", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
MOE = {"qwen3_moe", "mixtral"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, str]:
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param in MOE:
        return request.param, write_moe(path, request.param, seed=5)
    # the trained tokenizer's vocabulary (466: not whole blocks of 32, the head pads it)
    return request.param, write_tiny_model(path, request.param, seed=5,
                                           vocab_size=write_tokenizer(path))


class Rollout:
    def __init__(self, prompts, outputs, logprobs, routes, temperature):
        self.prompts, self.outputs, self.logprobs = prompts, outputs, logprobs
        self.routes, self.temperature = routes, temperature


def rollouts(path: str, dtype: str, moe: bool) -> list[Rollout]:
    """Seeded samples of a deterministic engine at temperatures 1 and 0.7."""
    rng = random.Random(3)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 30))] for _ in range(6)]
    out = []
    with Engine(path, dtype=dtype, deterministic=True, max_total_tokens=8192,
                enable_return_routed_experts=moe) as engine:
        for temperature in (1.0, 0.7):
            res = engine.generate(input_ids=prompts, return_logprob=True,
                                  return_routed_experts=moe, sampling_params=[
                                      {"max_new_tokens": rng.randint(6, 14), "seed": i,
                                       "temperature": temperature, "ignore_eos": True}
                                      for i in range(len(prompts))])
            out.append(Rollout(prompts, [r["output_ids"] for r in res],
                               [[lp for lp, _ in r["meta_info"]["output_token_logprobs"]]
                                for r in res],
                               [r["meta_info"].get("routed_experts") for r in res], temperature))
    return out


def hf_model(path: str, dtype: torch.dtype) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def padded(r: Rollout, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [p + o for p, o in zip(r.prompts, r.outputs, strict=True)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[b, cols], mask[b, cols] = torch.tensor(s), 1
    return ids, mask


def completion_logprobs(logp: torch.Tensor, mask: torch.Tensor, r: Rollout) -> list[torch.Tensor]:
    out = []
    for b, (p, o) in enumerate(zip(r.prompts, r.outputs, strict=True)):
        cols = mask[b].nonzero().flatten()
        out.append(logp[b, cols[len(p): len(p) + len(o)]])
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_equal_engine_bitwise(family, dtype):
    name, path = family
    torch_dtype = getattr(torch, dtype)
    exact = ExactForward(hf_model(path, torch_dtype))
    for r in rollouts(path, dtype, name in MOE):
        for left in (False, True):
            ids, mask = padded(r, left)
            with torch.no_grad():
                logp = exact(ids, mask, temperature=r.temperature)
            for b, got in enumerate(completion_logprobs(logp, mask, r)):
                assert torch.equal(got, torch.tensor(r.logprobs[b])), (name, dtype, b, left)
        # packed (padding-free), and the GRPO trainer's units: prompt once, responses after it
        flat = [t for p, o in zip(r.prompts, r.outputs, strict=True) for t in p + o]
        positions = [i for p, o in zip(r.prompts, r.outputs, strict=True)
                     for i in range(len(p + o))]
        seqs = packed_sequences(torch.tensor(flat), torch.tensor(positions))
        source, target, start = [], [], 0
        for p, o in zip(r.prompts, r.outputs, strict=True):
            source += [start + len(p) - 1 + t for t in range(len(o))]
            target += o
            start += len(p) + len(o)
        with torch.no_grad():
            got = exact.logprobs(seqs, torch.tensor(source), torch.tensor(target), r.temperature)
        assert torch.equal(got, torch.tensor([lp for lps in r.logprobs for lp in lps]))
        with torch.no_grad():  # verl's remove-padding layout: every next-token logprob
            rolled = exact.packed(torch.tensor([flat]), torch.tensor([positions]), r.temperature)
        assert torch.equal(rolled[torch.tensor(source)], got)
        assert not rolled[torch.tensor(positions[1:] + [0]) == 0].any()  # sequences' last
        p, outs = r.prompts[0], [r.outputs[0], r.outputs[0][:3], r.outputs[0][:5]]
        unit_ids = p + [t for o in outs for t in o[:-1]]
        unit_pos = list(range(len(p))) + [len(p) + t for o in outs for t in range(len(o) - 1)]
        unit_seg = [0] * len(p) + [k + 1 for k, o in enumerate(outs) for _ in o[:-1]]
        seqs, index = segment_sequences(torch.tensor([unit_ids + [0]]),
                                        torch.tensor([unit_pos + [0]]),
                                        torch.tensor([unit_seg + [-1]]))
        source, start = [], len(p)
        for o in outs:
            source += [len(p) - 1] + [start + t for t in range(len(o) - 1)]
            start += len(o) - 1
        with torch.no_grad():
            got = exact.logprobs(seqs, index[0][torch.tensor(source)],
                                 torch.tensor([t for o in outs for t in o]), r.temperature)
        want = [lp for o in outs for lp in r.logprobs[0][:len(o)]]
        assert torch.equal(got, torch.tensor(want))


def test_moe_routes_equal_engine(family):
    """The exact forward routes every token as the engine did: routing replay is unnecessary."""
    name, path = family
    if name not in MOE:
        pytest.skip("dense")
    exact = ExactForward(hf_model(path, torch.float32))
    r = rollouts(path, "float32", True)[0]
    seqs, index = padded_sequences(*padded(r, False))
    routes: list[torch.Tensor] = []
    with torch.no_grad():
        exact.hidden(seqs, routes)
    mine = torch.stack(routes, 1)  # [N, moe layers, top_k]
    for b, (p, o) in enumerate(zip(r.prompts, r.outputs, strict=True)):
        recorded = torch.as_tensor(r.routes[b]).long()  # prompt + completion - 1 positions
        assert recorded.shape[0] == len(p) + len(o) - 1
        assert torch.equal(mine[index[b, :len(recorded)]], recorded)


def test_gradients_match_hf(family):
    """fp32: the gradients of a weighted sum of completion logprobs through the exact forward
    match HF's own forward and backward within 1e-5 relative, every parameter."""
    name, path = family
    r = rollouts(path, "float32", name in MOE)[0]
    ids, mask = padded(r, False)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    score = torch.zeros(ids.shape, dtype=torch.bool)
    for b, (p, o) in enumerate(zip(r.prompts, r.outputs, strict=True)):
        score[b, len(p): len(p) + len(o)] = True
    ours, theirs = hf_model(path, torch.float32), hf_model(path, torch.float32)
    (ExactForward(ours)(ids, mask)[score] * weights[score]).sum().backward()
    logits = theirs(input_ids=ids, attention_mask=mask).logits.float()
    hf = torch.zeros(ids.shape)
    hf[:, 1:] = logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None])[..., 0]
    (hf[score] * weights[score]).sum().backward()
    for (n, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        if b.grad is None or b.grad.abs().max() == 0:
            assert a.grad is None or a.grad.abs().max() == 0, n
            continue
        rel = (a.grad - b.grad).norm() / b.grad.norm()
        assert rel <= 1e-5, (n, rel.item())


def test_refuses_what_it_cannot_run(family):
    name, path = family
    model = hf_model(path, torch.float16)
    with pytest.raises(ValueError, match="float32 or bf16"):
        ExactForward(model)
    with pytest.raises(ValueError, match="position_ids"):
        packed_sequences(torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3]))
