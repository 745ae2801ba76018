"""Tensor parallelism: generation tok/s and weight-update time at tp_size 1 vs N, side by side
(SmolLM2-135M has 9 heads and 3 KV heads: tp 3 is its split).

    python bench/tensor_parallel.py [--tp 1 3] [--repeats 2] [--prompts 16] [--new-tokens 32]

Each measurement runs in a fresh process (engine start, one warm-up request, then the timed
batch: chat prompts sampled at temperature 1 with eos ignored, then two full
update_weights_from_tensor pushes, then two full pushes from a WeightSender over gloo in which
every TP rank holds its own rank); the tp sizes alternate within every repeat, so a slow period
of a shared machine hits all of them. Prints the median of each and the ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from hotswap.weight_sync.group import free_port

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain photosynthesis in one sentence.", "List three prime numbers."]


def child(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    from hotswap.engine import Engine
    from hotswap.engine.models.fetch import ensure_model
    from hotswap.weight_sync import WeightSender

    path = ensure_model(args.model_path)
    start = time.perf_counter()
    with Engine(path, dtype="float32", device="cpu", tp_size=args.child) as engine:
        start_s = time.perf_counter() - start
        messages = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
                    for i in range(args.prompts)]
        params = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True,
                  "seed": 0}
        engine.generate(messages=messages[:1], sampling_params={**params, "max_new_tokens": 4})
        start = time.perf_counter()
        outs = engine.generate(messages=messages, sampling_params=params)
        gen_s = time.perf_counter() - start
        tensors = load_file(f"{path}/model.safetensors")
        updates = []
        for _ in range(2):
            start = time.perf_counter()
            assert engine.update_weights_from_tensor(tensors)["success"]
            updates.append(time.perf_counter() - start)
        # 1 trainer + one rank per TP rank of the engine.
        sender = WeightSender("127.0.0.1", free_port(), 1 + engine.weight_sync_ranks,
                              backend="gloo", timeout_s=600)
        sends = []
        try:
            for _ in range(2):
                start = time.perf_counter()
                assert sender.send(tensors, [engine])[0]["success"]
                sends.append(time.perf_counter() - start)
        finally:
            sender.close([engine])
    tokens = sum(len(o["output_ids"]) for o in outs)
    print(json.dumps({"tp": args.child, "tok_s": tokens / gen_s, "update_s": min(updates),
                      "dist_update_s": min(sends), "start_s": start_s}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-path", default=None)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args)
        return
    results: dict[int, list[dict]] = {tp: [] for tp in args.tp}
    for _ in range(args.repeats):
        for tp in args.tp:
            cmd = [sys.executable, __file__, "--child", str(tp), "--prompts", str(args.prompts),
                   "--new-tokens", str(args.new_tokens)]
            if args.model_path:
                cmd += ["--model-path", args.model_path]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            results[tp].append(json.loads(out.strip().splitlines()[-1]))
    base = statistics.median(r["tok_s"] for r in results[args.tp[0]])
    print(f"{'tp':>3} {'tok/s':>8} {'ratio':>6} {'update s':>9} {'dist s':>7} {'start s':>8}")
    for tp, runs in results.items():
        tok_s = statistics.median(r["tok_s"] for r in runs)
        print(f"{tp:>3} {tok_s:>8.1f} {tok_s / base:>6.2f} "
              f"{statistics.median(r['update_s'] for r in runs):>9.3f} "
              f"{statistics.median(r['dist_update_s'] for r in runs):>7.3f} "
              f"{statistics.median(r['start_s'] for r in runs):>8.1f}")


if __name__ == "__main__":
    main()
