"""Extend rows through the decode-attention kernel against padded SDPA, same run.

python bench/extend.py [--dtype bfloat16] [--repeats 5]
An extend row is a step's row with several new tokens: a prefill or one of its chunks, a
speculative verify step (the drafted tokens and the one after them), a new turn on a cached
history. On the CPU the attention backend runs such rows through the decode-attention kernel, a
query per token, or (on CPUs with AMX, bf16 rows past AMX_EXTEND_MAX_KEYS keys) through padded
SDPA. Each shape below, rows x (cached prefix + new tokens), is timed through Engine.generate
with one new token, after the prefixes were cached by an untimed call, so the timed call is one
extend step and its sampling; the backend is told to take the kernel for every extend row, then
SDPA past 128 keys, alternating within every repeat. ms medians and SDPA / kernel are printed.
Prompts are random token ids, distinct per row; (c) shares one prefix, as 64 questions after a
system prompt do.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model

# name -> (rows, cached prefix tokens per row, new tokens per row, rows share the prefix)
SHAPES = {
    "prefill 1 x 2000": (1, 0, 2000, False),
    "prefill 8 x 500": (8, 0, 500, False),
    "verify 1 x 500+5": (1, 500, 5, False),
    "verify 1 x 2000+5": (1, 2000, 5, False),
    "verify 4 x 2000+5": (4, 2000, 5, False),
    "verify 16 x 300+3": (16, 300, 3, False),
    "(c) 64 x 1000+30": (64, 1000, 30, True),
}
SDPA_PAST = 128  # keys: the limit an AMX CPU runs with (torch_backend.AMX_EXTEND_MAX_KEYS)


def prompts(rows: int, prefix: int, new: int, shared: bool, vocab: int
            ) -> tuple[list[list[int]], list[list[int]]]:
    """(the cached prefixes, the full prompts) of a shape, random ids from a fixed seed."""
    rng = random.Random(rows * 7919 + prefix * 31 + new)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    common = ids(prefix)
    heads = [common if shared else ids(prefix) for _ in range(rows)]
    return heads, [h + ids(new) for h in heads]


def timed(engine: Engine, heads: list[list[int]], full: list[list[int]], limit: float) -> float:
    """Seconds of one extend step over the cached heads, the backend's limit set to `limit`."""
    engine.runner.attn_backend.extend_max_keys = limit
    engine.flush_cache()
    if heads[0]:
        engine.generate(input_ids=heads, sampling_params={"max_new_tokens": 1})
    start = time.perf_counter()
    engine.generate(input_ids=full, sampling_params={"max_new_tokens": 1})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engine = Engine(ensure_model(args.model_path), dtype=args.dtype, max_total_tokens=80_000)
    if not engine.runner.attn_backend.fused_decode:
        raise SystemExit("the CPU kernels are not built here: every extend row takes SDPA")
    vocab = engine.model_config.vocab_size
    print(f"dtype {args.dtype}; this CPU's limit: {engine.runner.attn_backend.extend_max_keys} "
          f"keys; ms medians of {args.repeats}")
    print(f"{'shape':<20}{'kernel':>10}{'SDPA':>10}  SDPA / kernel")
    for name, (rows, prefix, new, shared) in SHAPES.items():
        heads, full = prompts(rows, prefix, new, shared, vocab)
        times: dict[float, list[float]] = {math.inf: [], SDPA_PAST: []}
        for i in range(args.repeats + 1):  # the first round is a warm-up
            for limit in (math.inf, SDPA_PAST) if i % 2 else (SDPA_PAST, math.inf):
                seconds = timed(engine, heads, full, limit)
                if i:
                    times[limit].append(seconds)
        kernel, sdpa = (statistics.median(times[k]) * 1e3 for k in (math.inf, SDPA_PAST))
        print(f"{name:<20}{kernel:>10.1f}{sdpa:>10.1f}  {sdpa / kernel:.2f}x", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
