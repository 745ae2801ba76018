"""RayFleet: generation throughput of 1 vs 2 replicas, and what a fleet update costs.

python bench/fleet.py [--model-path M] [--dtype bfloat16] [--prompts 64] [--new-tokens 64]
                      [--repeats 3]

On one local Ray with the machine's cores split evenly: one replica holding every core against
two replicas holding half each (the same cores, so on one machine two replicas can only win
what one engine leaves idle), and an in-process Engine with every core as the baseline. Then
updates of the full weights: `update_weights_from_tensor` (one ray.put, every replica reads it)
and a gloo `WeightSender` broadcast, for 1 and 2 replicas, against the in-process Engine's
update_weights_from_tensor. Medians of --repeats; ratios are within this run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from throughput import chat_prompts  # noqa: E402  bench/ is on sys.path as a script

from hotswap.engine import Engine  # noqa: E402
from hotswap.engine.models.fetch import ensure_model  # noqa: E402
from hotswap.fleet import RayFleet  # noqa: E402
from hotswap.weight_sync import WeightSender  # noqa: E402
from hotswap.weight_sync.group import free_port  # noqa: E402


def tok_per_s(client, ids: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    client.generate(input_ids=ids[:4], sampling_params={**params, "max_new_tokens": 4})
    start = time.perf_counter()
    outs = client.generate(input_ids=ids, sampling_params=params)
    seconds = time.perf_counter() - start
    return sum(len(o["output_ids"]) for o in outs) / seconds


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    path = ensure_model(args.model_path)
    cores = os.cpu_count() or 2
    kw = {"dtype": args.dtype, "max_total_tokens": 16384}
    weights = load_file(os.path.join(path, "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"{os.path.basename(path)} {args.dtype}, {cores} cores, {args.prompts} prompts x "
          f"{args.new_tokens} new tokens; updates of {len(weights)} tensors, {nbytes / 1e6:.0f} MB"
          f" ({next(iter(weights.values())).dtype}); median of {args.repeats}")

    rows: dict[str, dict[str, float]] = {}
    torch.set_num_threads(cores)
    with Engine(path, **kw) as engine:
        ids = chat_prompts(engine.tokenizer, args.prompts)
        rows["Engine, in process"] = {
            "tok/s": statistics.median(tok_per_s(engine, ids, args.new_tokens)
                                       for _ in range(args.repeats)),
            "tensor s": timed(lambda: engine.update_weights_from_tensor(weights), args.repeats)}

    ray.init(num_cpus=cores, include_dashboard=False, configure_logging=False)
    try:
        for replicas in (1, 2):
            share = max(1, cores // replicas)
            with RayFleet(path, replicas=replicas, engine_kwargs=kw,
                          resources_per_replica={"CPU": share}) as fleet:
                row = {"tok/s": statistics.median(tok_per_s(fleet, ids, args.new_tokens)
                                                  for _ in range(args.repeats))}
                row["tensor s"] = timed(lambda f=fleet: f.update_weights_from_tensor(weights),
                                        args.repeats)
                sender = WeightSender("127.0.0.1", free_port(),
                                      world_size=1 + fleet.weight_sync_ranks, backend="gloo")
                sender.connect([fleet])
                row["gloo s"] = timed(lambda f=fleet, s=sender: s.send(weights, [f]),
                                      args.repeats)
                sender.close([fleet])
                rows[f"RayFleet, {replicas} x {share} cores"] = row
    finally:
        ray.shutdown()

    base = rows["Engine, in process"]
    one = rows[f"RayFleet, 1 x {cores} cores"]
    print(f"\n| {'':28} | tok/s | vs Engine | update_weights_from_tensor s | vs 1 replica "
          "| gloo broadcast s | vs 1 replica |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, row in rows.items():
        gloo = row.get("gloo s")
        gloo_cells = ("| |" if gloo is None else
                      f"| {gloo:.3f} | {gloo / one['gloo s']:.2f} |")
        print(f"| {name:28} | {row['tok/s']:.0f} | {row['tok/s'] / base['tok/s']:.2f} "
              f"| {row['tensor s']:.3f} | {row['tensor s'] / one['tensor s']:.2f} {gloo_cells}")


if __name__ == "__main__":
    main()
