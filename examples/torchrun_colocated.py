"""Colocated RL under torchrun: every rank trains and generates, engines data parallel.

    torchrun --standalone --nproc_per_node 2 examples/torchrun_colocated.py [--steps 2]

Each rank builds the same Engine (`launcher="torchrun"`: engine k samples with seed + k) beside
its DDP replica of the policy (gloo), samples a group of completions for its own shard of the
prompts, and the ranks take one DDP step together (gradients all-reduced). After every
optimizer step each rank pushes the new weights into its own engine in-process. At the end rank 0
prints one JSON line: every rank's engine version and seed, the largest gap between its engine's
weights and the trainer's and between their logprobs of a greedy probe, and how far training
moved the first layer's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What do bees make?",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
    "What planet do we live on?",
    "What colour is the sky?",
    "How many days are in a week?",
]


def reward(text: str, finished: bool) -> float:
    """Prefer short, finished answers."""
    return (1.0 if finished else 0.0) - len(text.split()) / 40


def completion_logprobs(model: torch.nn.Module, prompts: list[list[int]],
                        completions: list[list[int]]) -> list[torch.Tensor]:
    """Every completion token's logprob under `model`, in one right-padded forward (DDP
    all-reduces the gradients of one forward/backward pair)."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
    logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        rows = logprobs[i, len(p) - 1: len(p) + len(c) - 1]
        out.append(rows.gather(1, torch.tensor(c)[:, None])[:, 0])
    return out


def chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def train_step(engine: Engine, ddp: DistributedDataParallel, optim: torch.optim.Optimizer,
               questions: list[str], args: argparse.Namespace) -> dict:
    messages = [[{"role": "user", "content": q}] for q in questions]
    start = time.perf_counter()
    outs = engine.generate(messages=messages, return_logprob=True, sampling_params={
        "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "n": args.group_size})
    gen_s = time.perf_counter() - start
    rewards = torch.tensor([reward(o["text"], o["meta_info"]["finish_reason"]["type"] == "stop")
                            for o in outs]).view(len(questions), args.group_size)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4))
    prompts = [chat_ids(engine, m) for m in messages for _ in range(args.group_size)]
    optim.zero_grad()
    logps = completion_logprobs(ddp, prompts, [o["output_ids"] for o in outs])
    loss = -sum(a * lp.sum() for a, lp in zip(adv.flatten(), logps)) / len(outs)
    loss.backward()  # DDP all-reduces the gradients over the ranks here
    optim.step()
    served = [torch.tensor([lp for lp, _ in o["meta_info"]["output_token_logprobs"]])
              for o in outs]
    gap = max((lp.detach() - s).abs().max().item() for lp, s in zip(logps, served))
    return {"reward": rewards.mean().item(), "gen_s": gen_s, "dlogp": gap,
            "tokens": sum(len(o["output_ids"]) for o in outs),
            "version": outs[0]["meta_info"]["weight_version"]}


def final_check(engine: Engine, policy: torch.nn.Module, initial: dict[str, torch.Tensor]
                ) -> dict:
    """How far the engine is from the trainer (weights, a greedy probe's logprobs), and how far
    training moved the weights the engine started with."""
    weight_gap = 0.0
    for name, param in policy.named_parameters():
        served = torch.tensor(engine.get_weights_by_name(name, truncate_size=1 << 30))
        weight_gap = max(weight_gap, (served - param.detach()).abs().max().item())
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    out = engine.generate(messages=messages, return_logprob=True,
                          sampling_params={"max_new_tokens": 8, "temperature": 0.0})
    with torch.no_grad():
        logp = completion_logprobs(policy, [chat_ids(engine, messages)], [out["output_ids"]])[0]
    served = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
    params = dict(policy.named_parameters())
    moved = max((params[n].detach() - t).abs().max().item() for n, t in initial.items())
    return {"version": engine.get_weight_version(), "seed": engine.config.seed,
            "weight_gap": weight_gap, "probe_dlogp": (logp - served).abs().max().item(),
            "trained_delta": moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per rank and step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=2e-5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    path = ensure_model(args.model_path)
    engine = Engine(path, dtype="float32", device="cpu", launcher="torchrun", seed=0)
    policy = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy.train()
    initial = {n: p.detach().clone() for n, p in policy.named_parameters()
               if n.startswith("model.layers.0.")}
    ddp = DistributedDataParallel(policy)
    optim = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0)
    for step in range(args.steps):
        first = (step * world + rank) * args.prompts  # this rank's shard of the prompts
        questions = [QUESTIONS[(first + i) % len(QUESTIONS)] for i in range(args.prompts)]
        stats = train_step(engine, ddp, optim, questions, args)
        start = time.perf_counter()
        result = engine.update_weights_from_tensor(
            [(n, p.detach()) for n, p in policy.named_parameters()],
            weight_version=f"step-{step + 1}")
        if not result["success"]:
            raise SystemExit(f"rank {rank}: weight update failed: {result['message']}")
        stats["update_s"] = time.perf_counter() - start
        every = [None] * world
        dist.all_gather_object(every, stats)
        if rank == 0:
            print(f"step {step}: " + " | ".join(
                f"rank {r} v{s['version']} reward {s['reward']:.3f} "
                f"{s['tokens'] / s['gen_s']:.0f} tok/s |dlogp| {s['dlogp']:.1e} "
                f"update {s['update_s']:.2f}s" for r, s in enumerate(every)), flush=True)
    checks = [None] * world
    dist.all_gather_object(checks, final_check(engine, policy, initial))
    if rank == 0:
        print(json.dumps({"world_size": world, "ranks": checks}), flush=True)
    engine.shutdown()
    dist.destroy_process_group()
    # torch 2.13's gloo worker threads free a finished collective's tensors (taking the GIL)
    # after the caller's wait has returned, and destroy_process_group does not join them: if
    # that lands in interpreter finalization the process aborts ("terminate called without an
    # active exception", seen in CI and in core dumps here, also after a barrier, whose work
    # holds the previous ones). So the script ends without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
