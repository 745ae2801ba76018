"""Multi-LoRA throughput: the same batch on the base model, on one adapter, and on 8 adapters
mixed in every step, in one engine and one run (rounds alternate the three).

python bench/multi_lora.py [--prompts 32] [--new-tokens 32] [--rank 8] [--rounds 2]
Adapters are random (non-zero B) on all seven projections, loaded with
load_lora_adapter_from_tensors under PEFT names. Greedy, eos ignored, each round from an empty
prefix cache (a distinct cache_salt), so every round computes the same prefill and decode work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def random_adapter(cfg: dict, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """PEFT-named A/B tensors for every decoder layer and target of a Llama config."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        for target, block in TARGETS.items():
            fan_in, fan_out = dims[target]
            name = f"base_model.model.model.layers.{layer}.{block}.{target}"
            out[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            out[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    return out


def run(engine: Engine, prompts: list[list[int]], loras: list[str | None], new_tokens: int,
        salt: str) -> float:
    """Generated tokens per second for one batch."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, lora_name=loras,
                           cache_salt=salt)
    elapsed = time.perf_counter() - start
    return sum(len(o["output_ids"]) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default="models/smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    path = ensure_model(args.model_path)
    with Engine(path, dtype="float32", max_total_tokens=32768, max_lora_rank=args.rank,
                max_loras_per_batch=args.adapters) as engine:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        config = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": list(TARGETS)}
        names = [f"adapter{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            engine.load_lora_adapter_from_tensors(name, random_adapter(cfg, args.rank, i), config)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, 40000, (args.prompt_tokens,), generator=gen).tolist()
                   for _ in range(args.prompts)]
        cases = {"base only": [None] * args.prompts,
                 "1 adapter": [names[0]] * args.prompts,
                 f"{args.adapters} adapters mixed": [names[i % args.adapters]
                                                     for i in range(args.prompts)]}
        run(engine, prompts[:4], [None, names[0], names[1], None], 4, "warmup")
        results: dict[str, list[float]] = {case: [] for case in cases}
        for r in range(args.rounds):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for case in order:
                results[case].append(run(engine, prompts, cases[case], args.new_tokens,
                                         f"{case}-{r}"))
                print(f"round {r}: {case}: {results[case][-1]:.1f} tok/s", flush=True)
    print(f"{args.prompts} prompts x {args.prompt_tokens} tokens -> {args.new_tokens} new tokens, "
          f"rank {args.rank}, all 7 targets, {args.rounds} rounds (median tok/s)")
    base = statistics.median(results["base only"])
    for case, values in results.items():
        med = statistics.median(values)
        print(f"  {case:<20} {med:8.1f} tok/s   {med / base:5.2f}x base   "
              f"(rounds: {', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
