"""Throughput: hotswap vs HF transformers `generate` on the same model, workloads and machine.

python bench/throughput.py [--workloads a,b,c,g] [--repeats 1] [--skip-hf]
(a) 64 distinct chat prompts x 64 new tokens; (b) GRPO-style 8 prompts x n=8 x 64 new tokens;
(c) a ~1,000-token shared system prompt + 64 short questions x 32 new tokens.
Sampling at temperature 1.0, eos ignored on both sides so every request makes its full length.
Each repeat runs hotswap (from an empty prefix cache) and then HF; medians are printed.
(g) workload (b) with a JSON schema on every request against the same unconstrained, both in
hotswap, alternated; it prints the share of step time spent on grammar masks.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import time

import torch
import transformers

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model

TOPICS = ["the ocean", "volcanoes", "bread", "chess", "the moon", "bees", "trains", "music",
          "glaciers", "rivers", "owls", "clocks", "maps", "tea", "bridges", "deserts"]
STYLES = ["a short poem about", "three facts about", "a story opening about",
          "a simple explanation of"]


def chat_prompts(tokenizer, n: int, system: str | None = None) -> list[list[int]]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Write {STYLES[i % 4]} {TOPICS[i % 16]}, "
                                            f"variation {i}."}]
        if system:
            msgs.insert(0, {"role": "system", "content": system})
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def long_system_prompt(tokenizer, tokens: int = 1000) -> str:
    sentence = ("You are a careful assistant for a science museum; answer visitors' questions "
                "accurately, kindly and briefly, and say so when you are unsure. ")
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += sentence
    return text


def workloads(tokenizer, chosen: str) -> dict[str, tuple[list[list[int]], int, int]]:
    """name -> (distinct prompts, samples per prompt, new tokens)."""
    all_ = {
        "a": (chat_prompts(tokenizer, 64), 1, 64),
        "b": (chat_prompts(tokenizer, 8), 8, 64),
        "c": (chat_prompts(tokenizer, 64, long_system_prompt(tokenizer)), 1, 32),
    }
    return {k: v for k, v in all_.items() if k in chosen.split(",")}


def unique_prefix_tokens(prompts: list[list[int]]) -> int:
    """Tokens a perfect prefix cache computes: the nodes of the prompts' trie."""
    ordered = sorted(prompts)
    shared = sum(len(os.path.commonprefix([a, b])) for a, b in zip(ordered, ordered[1:]))
    return sum(len(p) for p in ordered) - shared


def run_hotswap(engine: Engine, prompts: list[list[int]], n: int, new: int) -> dict:
    before = dict(engine.scheduler.stats)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": new, "n": n, "temperature": 1.0, "ignore_eos": True})
    elapsed = time.perf_counter() - start
    after = engine.scheduler.stats
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"tok_s": tokens / elapsed, "seconds": elapsed, "tokens": tokens,
            "prefill_computed": after["prefill_tokens"] - before["prefill_tokens"],
            "prompt_submitted": after["prompt_tokens"] - before["prompt_tokens"]}


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


def run_hf(path: str, prompts: list[list[int]], n: int, new: int, pad_id: int) -> dict:
    """HF generate with static batching and left padding (runs in its own process)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                             temperature=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new,
                             num_return_sequences=n, pad_token_id=pad_id, eos_token_id=None)
    elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - width) * out.shape[0]
    return {"tok_s": tokens / elapsed, "seconds": elapsed, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--workloads", default="a,b,c,g")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    path = ensure_model(args.model_path)
    # HF runs in a separate process: two OpenMP thread teams in one process on 2 cores slow
    # each other down (see README), which would bias the comparison either way.
    hf_pool = None if args.skip_hf else mp.get_context("spawn").Pool(1)
    engine = Engine(path, dtype="float32")
    tokenizer = engine.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    print(f"torch threads: {torch.get_num_threads()}, model: {path}")
    print(f"{'workload':<10}{'hotswap tok/s':>15}{'HF tok/s':>12}{'ratio':>8}"
          f"{'prefill computed / submitted':>32}")
    for name, (prompts, n, new) in workloads(tokenizer, args.workloads).items():
        # Alternate the two sides so that a slower period of this (shared) machine hits both;
        # every hotswap run starts from an empty prefix cache, as HF does.
        ours, theirs = [], []
        for _ in range(args.repeats):
            engine.flush_cache()
            ours.append(run_hotswap(engine, prompts, n, new))
            if hf_pool is not None:
                theirs.append(hf_pool.apply(run_hf, (path, prompts, n, new, pad))["tok_s"])
        ours_med = statistics.median(r["tok_s"] for r in ours)
        hf_med = statistics.median(theirs) if theirs else float("nan")
        unique = unique_prefix_tokens(prompts)
        r = ours[0]
        print(f"{name:<10}{ours_med:>15.1f}{hf_med:>12.1f}{ours_med / hf_med:>8.2f}"
              f"{r['prefill_computed']:>14} / {r['prompt_submitted']:<8} (unique {unique})",
              flush=True)
    if "g" in args.workloads.split(","):
        grammar_comparison(engine, tokenizer, max(args.repeats, 2))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS (hotswap process): {rss:.0f} MiB")
    engine.shutdown()
    if hf_pool is not None:
        hf_pool.close()
        hf_pool.join()


if __name__ == "__main__":
    main()
