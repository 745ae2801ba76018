"""Prefix tiers: a cycle of eight long-prefix prompts through a device pool that holds one.

python bench/hicache.py [--prefix-tokens 1000] [--new-tokens 16] [--passes 2] [--repeats 1]
Each prompt is a distinct long document followed by a short question (chat template), sent one
at a time, the cycle repeated `--passes` times. Configurations, each in a fresh process (two
engines in one process slow each other's threads), alternating within every repeat:
- device: the prefix cache on a device pool sized for one prompt (no lower tier);
- host: the same pool plus a host tier that holds all eight (`enable_hierarchical_cache`);
- host+storage: as host, also writing evicted prefixes to a `hicache_storage_dir`;
- write-through: as host+storage with `hicache_write_policy="write_through"` (every finished
  request's prefix is written down at once, not at eviction), into a folder of its own;
- storage: a fresh process (empty host tier) on that folder: its single pass reads the
  prefixes the host+storage process wrote.
Printed per configuration: prefill tokens computed (prompt - cached, over all requests), where
the cached tokens came from (device / host / storage), wall seconds, and tokens/s (prompt +
generated tokens served per second, the work a client sees done).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model

TOPICS = ["harbours", "glaciers", "printing presses", "beekeeping", "railways", "lighthouses",
          "observatories", "canals"]


def prompts(tokenizer, prefix_tokens: int) -> list[list[int]]:
    out = []
    for i, topic in enumerate(TOPICS):
        sentence = (f"Document {i} is a field report on {topic}: the surveyors counted, measured "
                    f"and described {topic} in district {i} over many seasons. ")
        text = ""
        while len(tokenizer.encode(text)) < prefix_tokens:
            text += sentence
        msgs = [{"role": "user", "content": f"{text}\nSummarise document {i} in one line."}]
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def child(args: argparse.Namespace) -> None:
    """One configuration in this process; prints one JSON line."""
    longest = int(args.prompt_len)
    options = {"dtype": "float32", "max_total_tokens": longest + args.new_tokens + 64}
    if args.config != "device":
        options.update(enable_hierarchical_cache=True,
                       hicache_host_tokens=8 * (longest + args.new_tokens + 8))
    if args.config in ("host+storage", "write-through", "storage"):
        options["hicache_storage_dir"] = args.storage_dir
    if args.config == "write-through":
        options["hicache_write_policy"] = "write_through"
    with Engine(args.model, **options) as engine:
        ps = prompts(engine.tokenizer, args.prefix_tokens)
        params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})  # warm-up
        start = time.perf_counter()
        outs = [engine.generate(input_ids=p, sampling_params=params)
                for _ in range(args.passes) for p in ps]
        wall = time.perf_counter() - start
    metas = [o["meta_info"] for o in outs]
    served = sum(m["prompt_tokens"] + m["completion_tokens"] for m in metas)
    result = {"config": args.config, "wall_s": wall, "tok_s": served / wall,
              "prefill_computed": sum(m["prompt_tokens"] - m["cached_tokens"] for m in metas),
              "prompt_tokens": sum(m["prompt_tokens"] for m in metas)}
    for tier in ("device", "host", "storage"):
        result[tier] = sum(m["cached_tokens_details"][tier] for m in metas)
    print(json.dumps(result), flush=True)


def run_child(base: argparse.Namespace, config: str, passes: int, storage_dir: str) -> dict:
    cmd = [sys.executable, __file__, "--child", config, "--model", base.model,
           "--prefix-tokens", str(base.prefix_tokens), "--new-tokens", str(base.new_tokens),
           "--passes", str(passes), "--storage-dir", storage_dir,
           "--prompt-len", str(base.prompt_len)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--child", default=None,
                   choices=["device", "host", "host+storage", "write-through", "storage"])
    p.add_argument("--storage-dir", default=None)
    p.add_argument("--prompt-len", type=int, default=0)
    args = p.parse_args()
    args.model = args.model or ensure_model(os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
        "smollm2-135m-instruct"))
    if args.child:
        args.config = args.child
        child(args)
        return
    with Engine(args.model, max_total_tokens=64) as probe:  # only for the tokenizer
        args.prompt_len = max(map(len, prompts(probe.tokenizer, args.prefix_tokens)))
    rows: dict[str, list[dict]] = {"device": [], "host": [], "host+storage": [],
                                   "write-through": [], "storage": []}
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as store, tempfile.TemporaryDirectory() as own:
            order = ["device", "host", "host+storage", "write-through"]
            for config in order if r % 2 == 0 else order[::-1]:
                folder = own if config == "write-through" else store
                rows[config].append(run_child(args, config, args.passes, folder))
            rows["storage"].append(run_child(args, "storage", 1, store))
    print(f"8 prompts of {args.prompt_len} tokens max x {args.new_tokens} new tokens, one at a "
          f"time; device pool {args.prompt_len + args.new_tokens + 64} tokens; "
          f"median of {args.repeats}")
    print(f"{'config':13} {'passes':>6} {'prefill computed':>17} {'of prompt':>10} "
          f"{'device':>7} {'host':>7} {'storage':>8} {'wall s':>7} {'tok/s':>7}")
    for config, results in rows.items():
        med = {k: statistics.median(x[k] for x in results) for k in results[0] if k != "config"}
        passes = 1 if config == "storage" else args.passes
        print(f"{config:13} {passes:>6} {med['prefill_computed']:>17.0f} "
              f"{med['prompt_tokens']:>10.0f} {med['device']:>7.0f} {med['host']:>7.0f} "
              f"{med['storage']:>8.0f} {med['wall_s']:>7.2f} {med['tok_s']:>7.1f}")


if __name__ == "__main__":
    main()
