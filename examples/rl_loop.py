"""A small GRPO-style RL loop with live weight updates, on CPU by default.

Each step: the engine samples a group of completions per prompt (with per-token logprobs and
the weight version that produced them), a reward scores them, the trainer (HF transformers)
recomputes the same logprobs, takes a policy-gradient step on group-normalised advantages, and
pushes the new weights into the running engine. The printed `|dlogp|` is the largest gap between
the engine's and the trainer's logprob of a sampled token: it stays ~1e-5 after every update,
which is the engine serving exactly the trainer's current weights.

python examples/rl_loop.py [--steps 4] [--transport tensor|gloo]
"""

from __future__ import annotations

import argparse
import socket
import time

import torch
import transformers

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model
from hotswap.weight_sync import WeightSender

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What do bees make?",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
    "What planet do we live on?",
]


def reward(text: str, finished: bool) -> float:
    """Prefer short, finished answers: the policy should learn to be concise."""
    return (1.0 if finished else 0.0) - len(text.split()) / 40


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]
                     ) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--transport", choices=["tensor", "gloo"], default="tensor")
    args = parser.parse_args()
    torch.manual_seed(0)

    path = ensure_model(args.model_path)
    engine = Engine(path, dtype="float32", seed=0)
    policy = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy.train()
    optim = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    sender = None
    if args.transport == "gloo":
        sender = WeightSender("127.0.0.1", free_port(), world_size=2, backend="gloo",
                              bucket_bytes=32 << 20)
    print(f"engine on {engine.config.device}, weight version {engine.get_weight_version()}, "
          f"transport {args.transport}")
    print(f"{'step':>4} {'version':>7} {'reward':>7} {'words':>6} {'gen tok/s':>9} "
          f"{'|dlogp|':>8} {'train s':>7} {'update s':>8}")
    for step in range(args.steps):
        questions = [QUESTIONS[(step * args.prompts + i) % len(QUESTIONS)]
                     for i in range(args.prompts)]
        messages = [[{"role": "user", "content": q}] for q in questions]
        start = time.perf_counter()
        outs = engine.generate(messages=messages, return_logprob=True, sampling_params={
            "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "n": args.group_size})
        gen_s = time.perf_counter() - start
        version = outs[0]["meta_info"]["weight_version"]
        rewards = torch.tensor([reward(o["text"], o["meta_info"]["finish_reason"]["type"]
                                       == "stop") for o in outs])
        groups = rewards.view(args.prompts, args.group_size)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4))
        start = time.perf_counter()
        optim.zero_grad()
        gap = 0.0
        for i, out in enumerate(outs):
            prompt = engine.tokenizer.apply_chat_template(
                messages[i // args.group_size], tokenize=True, add_generation_prompt=True)
            prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            logp = trainer_logprobs(policy, prompt, out["output_ids"])
            served = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
            gap = max(gap, (logp.detach() - served).abs().max().item())
            loss = -(adv.flatten()[i] * logp.sum()) / len(outs)
            loss.backward()
        optim.step()
        train_s = time.perf_counter() - start
        start = time.perf_counter()
        named = [(n, p.detach()) for n, p in policy.named_parameters()]
        if sender is None:
            result = engine.update_weights_from_tensor(named)
        else:
            result = sender.send(named, [engine])[0]
        if not result["success"]:
            raise SystemExit(f"weight update failed: {result['message']}")
        update_s = time.perf_counter() - start
        tokens = sum(len(o["output_ids"]) for o in outs)
        words = sum(len(o["text"].split()) for o in outs) / len(outs)
        print(f"{step:>4} {version:>7} {rewards.mean():>7.3f} {words:>6.1f} "
              f"{tokens / gen_s:>9.1f} {gap:>8.1e} {train_s:>7.1f} {update_s:>8.2f}")
    print(f"final weight version {engine.get_weight_version()}")
    if sender is not None:
        sender.close([engine])
    engine.shutdown()


if __name__ == "__main__":
    main()
