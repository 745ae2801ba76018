"""Grammar overhead: workload (b) of throughput.py (GRPO, 8 prompts x n=8 x 64 new tokens) with a
JSON schema on every request against the same batch unconstrained, in one engine, alternated.

python bench/grammar.py [--repeats 2] [--dtype float32]
Prints both tokens/s, their ratio and the share of step time spent on grammar masks.
"""

from __future__ import annotations

import argparse
import statistics
import time

from throughput import chat_prompts

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model

GRPO_SCHEMA = {"type": "object", "properties": {
    "steps": {"type": "array", "items": {"type": "string", "maxLength": 120},
              "minItems": 4, "maxItems": 8},
    "answer": {"type": "integer", "minimum": 0, "maximum": 1000}},
    "required": ["steps", "answer"]}


def run_grammar(engine: Engine, prompts: list[list[int]], n: int, new: int,
                schema: dict | None) -> dict:
    """One GRPO batch, constrained by `schema` or not; grammar time from the engine's stats."""
    sched = engine.scheduler
    before = (dict(sched.stats), dict(sched.grammars.stats), dict(sched.sampler.stats))
    params = {"max_new_tokens": new, "n": n, "temperature": 1.0, "ignore_eos": True}
    if schema is not None:
        params["json_schema"] = schema
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    step_s = sched.stats["step_s"] - before[0]["step_s"]
    # On the scheduler thread: waiting for / filling masks, accepting tokens, applying masks.
    critical = (sched.grammars.stats["critical_s"] - before[1]["critical_s"]
                + sched.sampler.stats["mask_s"] - before[2]["mask_s"])
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"tok_s": tokens / elapsed, "tokens": tokens, "mask_share": critical / step_s,
            "fill_share": (sched.grammars.stats["fill_s"] - before[1]["fill_s"]) / step_s}


def grammar_comparison(engine: Engine, tokenizer, repeats: int) -> None:
    prompts = chat_prompts(tokenizer, 8)
    engine.generate(input_ids=prompts[0], sampling_params={  # compile once, outside timing
        "json_schema": GRPO_SCHEMA, "max_new_tokens": 1})
    plain, constrained = [], []
    for _ in range(repeats):
        for schema, results in ((None, plain), (GRPO_SCHEMA, constrained)):
            engine.flush_cache()
            results.append(run_grammar(engine, prompts, 8, 64, schema))
    p = statistics.median(r["tok_s"] for r in plain)
    c = statistics.median(r["tok_s"] for r in constrained)
    share = statistics.median(r["mask_share"] for r in constrained)
    fill = statistics.median(r["fill_share"] for r in constrained)
    print(f"g (GRPO 8x8x64, JSON schema on every request): unconstrained {p:.1f} tok/s, "
          f"constrained {c:.1f} tok/s, ratio {c / p:.2f}; tokens {plain[0]['tokens']} / "
          f"{constrained[0]['tokens']}; mask work on the step's critical path "
          f"{100 * share:.1f}% of step time (+{100 * fill:.1f}% filled on the worker during "
          f"the forward)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with Engine(ensure_model(args.model_path), dtype=args.dtype) as engine:
        grammar_comparison(engine, engine.tokenizer, args.repeats)


if __name__ == "__main__":
    main()
