"""Where a step's time goes: torch.profiler in the scheduler thread, ops grouped by kind.

python bench/profile_step.py [--dtype bfloat16] [--quantization int8] [--batch 64] [--new 64]
                             [--top 15]
Runs `batch` chat prompts x `new` tokens (temperature 1, eos ignored) and profiles every step in
the scheduler thread. Prints, for the prefill step and the mean decode step: matmuls, attention
(scores, softmax, weighted sum), KV gather, KV store, norms/rotary/activations and other
elementwise ops (bf16 on AMX: the SiLU-and-multiply inside the gate | up matmul; bf16 up to
SMALL_ROWS rows: the norms and SiLU between a layer's matmuls, hotswap::small_layers), the lm_head,
sampling, and the scheduler's own Python (step wall time minus the forward and the sampler).
"""

from __future__ import annotations

import argparse
import collections
import random
import time

from throughput import chat_prompts  # bench/ is on sys.path when run as a script
from torch.profiler import ProfilerActivity, profile, record_function

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model

MATMUL = {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear",
          "aten::matmul", "hotswap::small_linear", "hotswap::int8_linear", "aten::_int_mm",
          "hotswap::blocked_linear", "hotswap::amx_linear", "hotswap::small_layers"}
ATTENTION = {"aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::softmax",
             "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::scaled_dot_product_attention", "hotswap::decode_attention"}
KIND_OF = {"aten::index_select": "kv gather", "aten::index_copy_": "kv store",
           "aten::index_copy": "kv store", "hotswap::store_kv": "kv store"}
SCOPES = ("hs::step", "hs::forward", "hs::lm_head", "hs::sample")


def kind(name: str) -> str:
    if name in MATMUL:
        return "matmuls"
    if name in ATTENTION:
        return "attention"
    return KIND_OF.get(name, "norms/rotary/act/other")


def instrument(engine: Engine) -> None:
    """Label the step, the forward, the lm_head and the sampler with record_function scopes."""
    sched, runner = engine.scheduler, engine.runner
    model = runner.model

    def scoped(label, fn):
        def wrapper(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return wrapper

    sched.step = scoped("hs::step", sched.step)
    runner.forward = scoped("hs::forward", runner.forward)
    model.logits = scoped("hs::lm_head", model.logits)
    sched.sampler.sample = scoped("hs::sample", sched.sampler.sample)


def breakdown(prof) -> dict[str, float]:
    """ms per kind inside the forward (self CPU time), plus the labelled scopes."""
    out: dict[str, float] = collections.defaultdict(float)
    events = prof.events()
    scoped = [(e.time_range.start, e.time_range.end) for e in events
              if e.name in ("hs::lm_head", "hs::sample")]
    for e in events:
        if e.name in SCOPES:
            out[e.name] += e.cpu_time_total / 1e3
            continue
        if any(s <= e.time_range.start and e.time_range.end <= t for s, t in scoped):
            continue  # counted under the lm_head or the sampler scope
        out[kind(e.name)] += e.self_cpu_time_total / 1e3
        out["op " + e.name] += e.self_cpu_time_total / 1e3
    return out


def run(engine: Engine, prompts: list[list[int]], new: int) -> list[tuple[bool, dict]]:
    """Profile each step separately; returns (is_prefill, breakdown) per step."""
    steps: list[tuple[bool, dict]] = []
    sched = engine.scheduler
    inner = sched.step

    def profiled_step() -> bool:
        before = sched.stats["prefill_tokens"]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            did = inner()
        if did:
            steps.append((sched.stats["prefill_tokens"] > before, breakdown(prof)))
        return did

    sched.step = profiled_step
    engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": new, "temperature": 1.0, "ignore_eos": True})
    sched.step = inner
    return steps


def report(title: str, rows: list[dict], top: int = 0) -> None:
    if not rows:
        return
    keys = ["matmuls", "attention", "kv gather", "kv store", "norms/rotary/act/other",
            "hs::lm_head", "hs::sample"]
    mean = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys + list(SCOPES)}
    sched_py = mean["hs::step"] - mean["hs::forward"] - mean["hs::sample"]
    print(f"{title} ({len(rows)} steps): step {mean['hs::step']:.2f} ms")
    for k in keys:
        print(f"  {k.replace('hs::', ''):<26}{mean[k]:>8.2f} ms")
    print(f"  {'scheduler python':<26}{sched_py:>8.2f} ms")
    ops = collections.defaultdict(float)
    for r in rows:
        for k, v in r.items():
            if k.startswith("op "):
                ops[k[3:]] += v / len(rows)
    for name, ms in sorted(ops.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {name:<40}{ms:>8.2f} ms  ({kind(name)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--top", type=int, default=0, help="also list the N costliest ops")
    parser.add_argument("--quantization", choices=["int8"], default=None)
    args = parser.parse_args()
    engine = Engine(ensure_model(args.model_path), dtype=args.dtype,
                    quantization=args.quantization)
    instrument(engine)
    if engine.tokenizer.chat_template is not None:
        prompts = chat_prompts(engine.tokenizer, args.batch)
    else:  # a model without a chat template (bench/moe.py's): 32 random ids each
        rng = random.Random(0)
        prompts = [[rng.randrange(3, engine.model_config.vocab_size) for _ in range(32)]
                   for _ in range(args.batch)]
    run(engine, prompts[:2], 4)  # warm-up: packs, allocator, first-call paths
    engine.flush_cache()
    start = time.perf_counter()
    steps = run(engine, prompts, args.new)
    print(f"dtype {args.dtype}, batch {args.batch}, {time.perf_counter() - start:.2f} s "
          f"(profiled, slower than unprofiled)")
    report("prefill", [b for p, b in steps if p], args.top)
    report("decode", [b for p, b in steps if not p][1:], args.top)
    engine.shutdown()


if __name__ == "__main__":
    main()
