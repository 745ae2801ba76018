"""Speculative decoding: tok/s with each draft kind against no speculation, same run.

python bench/speculative.py [--dtype auto] [--workloads 1,edit,tail,64] [--repeats 3]
                            [--temperature 1.0] [--drafts ngram,self] [--unseeded]
python bench/speculative.py --draft [--drift 10]   # the learned draft (MODEL/draft)
(1) batch 1: chat prompts one at a time, 128 new tokens; goal for the self-draft >= 1.4x.
(edit) batch 1: "rewrite this text with one change" prompts, whose answer repeats the input,
256 new tokens at most (eos ends them); goal for n-gram drafts >= 2x.
(tail) a GRPO batch, 8 prompts x n=8: 56 samples of 48 new tokens and 8 of 320 (6.7x longer),
eos ignored; the wall time of the whole batch; goal >= 1.3x faster.
(64) batch 64: 64 chat prompts x 64 new tokens, eos ignored; goal >= 0.95x.
Every engine (no speculation, then one per draft kind) runs in its own process and each repeat
runs them one after the other (rotating who goes first), so a slow period of this shared
machine hits all of them; the ratio printed is the median of the per-repeat ratios. Each engine
first runs every workload once untimed: the draft length of a step is learnt from measured step
times (engine/speculative/lengths.py), once per batch size, and a served engine has learnt it
long before. Also printed per draft kind: drafted tokens kept per verify step, the share of
drafted tokens kept, and the verify steps' share of decode rows.

Then the costs that decide whether a draft pays, at batch 1 on workload (1)'s first prompt and
on (edit)'s, with the draft length pinned: seconds per decode step (drafting included) against a
plain step, drafting seconds per drafted token, and tokens emitted per step.

--draft: the learned draft (speculative="draft", made by python -m
hotswap.engine.speculative.train_draft MODEL) beside no speculation, on (1), (tail) and (64);
goals: >= 1.5x at batch 1, >= 1.3x on the tail, >= 0.97x at batch 64, >= 2.0 tokens per verify
step (kept drafts + the target's own token). Requests are seeded as above (a seeded row drafts
the token whose interval of q's CDF covers most of the target's own uniform +- 0.3);
--unseeded drops the seeds (rows then draw from q at the request's temperature times the draft's
proposal_scale and are verified by min(1, p/q)). --drift N then runs the GRPO main job for N steps
twice, the draft trained beside the policy and the draft frozen (--freeze-draft), and prints
each step's drafted tokens kept per drafted token in both.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import transformers

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model

TOPICS = ["the ocean", "volcanoes", "bread", "chess", "the moon", "bees", "trains", "music",
          "glaciers", "rivers", "owls", "clocks", "maps", "tea", "bridges", "deserts"]
PASSAGES = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors may "
    "borrow up to five books at a time for three weeks. Quiet rooms on the second floor can be "
    "booked a day in advance, and the cafe near the entrance serves tea, coffee and soup.",
    "Our team meets every Monday to plan the week. Each person shares what they finished, what "
    "they are working on, and anything that blocks them. Notes are written in the shared "
    "document, and tasks are assigned before the meeting ends so that nobody is left waiting.",
    "To bake the bread, mix the flour, water, salt and yeast in a large bowl. Knead the dough "
    "for ten minutes, then let it rise for an hour. Shape it into a loaf, let it rise again, "
    "and bake it at two hundred degrees for thirty minutes until the crust is golden.",
    "The river starts in the mountains, where snow melts each spring. It flows through forests "
    "and farms, past three small towns, and reaches the sea after two hundred kilometres. "
    "Fishermen work near its mouth, and birds gather on its banks in the autumn.",
]
EDITS = ["Replace every 'and' with 'plus'", "Change the first sentence to the past tense",
         "Replace the word 'the' with 'a' where it starts a sentence",
         "Keep the text the same but put it in one paragraph"]

_ENGINE: Engine | None = None


def _start_engine(path: str, dtype: str, kwargs: dict) -> None:
    global _ENGINE
    _ENGINE = Engine(path, dtype=dtype, **kwargs)


def chat(tokenizer, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                        add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def workloads(tokenizer, chosen: str, temperature: float, seeded: bool = True
              ) -> dict[str, list[tuple[list, list]]]:
    """name -> calls, each (prompts, per-prompt sampling params) given to one generate()."""
    def params(new: int, ignore_eos: bool = True, n: int = 1) -> dict:
        return {"max_new_tokens": new, "temperature": temperature, "ignore_eos": ignore_eos,
                "n": n, "seed": 11 if seeded else None}

    chats = [chat(tokenizer, f"Write a short story about {t}.") for t in TOPICS]
    edits = [chat(tokenizer, f"{EDITS[i]} in this text, and write out the whole text:\n\n"
                             f"{PASSAGES[i]}") for i in range(4)]
    grpo = [chat(tokenizer, f"Explain {t} to a child.") for t in TOPICS[:8]]
    makers = {
        "1": lambda: [([p], [params(128)]) for p in chats[:4]],
        "edit": lambda: [([p], [params(256, ignore_eos=False)]) for p in edits],
        # n=8 groups where sample 7 of each group is 6.7x longer: per-sample lengths, so the
        # samples go as 64 single requests of one call (seeds differ by sample)
        "tail": lambda: [([p for p in grpo for _ in range(8)],
                          [{**params(320 if j == 7 else 48),
                            "seed": 100 * i + j if seeded else None}
                           for i in range(8) for j in range(8)])],
        "64": lambda: [([chats[i % 16] + [i % 7 + 100] for i in range(64)], [params(64)] * 64)],
    }
    return {k: makers[k]() for k in chosen.split(",")}


def run(calls: list[tuple[list, list]]) -> dict:
    engine = _ENGINE
    engine.flush_cache()
    before = dict(engine.scheduler.stats)
    start = time.perf_counter()
    tokens = 0
    for prompts, sp in calls:
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        tokens += sum(len(o["output_ids"]) for o in outs)
    seconds = time.perf_counter() - start
    after = engine.scheduler.stats
    delta = {k: after[k] - before[k] for k in after}
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, **delta}


def pinned(calls: list[tuple[list, list]], length: int) -> dict:
    """run() with every step's draft length pinned to `length`."""
    spec = _ENGINE.scheduler.spec
    spec.lengths.choose = lambda batch: length
    if spec.learned is not None:  # the costs of drafting, whatever the draft's acceptance
        spec.learned.floor, spec.learned.off_reason = 0.0, None
    try:
        return run(calls)
    finally:
        del spec.lengths.choose


def lengths_table() -> dict:
    spec = _ENGINE.scheduler.spec
    if spec is None:
        return {}
    out = {"rates": spec.lengths.table()}
    if spec.self_draft is not None:
        out["self_layers"] = spec.self_draft.layers
        out["calibration"] = spec.self_draft.calibration
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workloads", default="1,edit,tail,64")
    parser.add_argument("--drafts", default="ngram,self")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--self-layers", type=int, default=None,
                        help="speculative_self_layers (default: calibrated)")
    parser.add_argument("--draft", action="store_true",
                        help="the learned draft: --drafts draft --workloads 1,tail,64")
    parser.add_argument("--unseeded", action="store_true", help="requests without seeds")
    parser.add_argument("--drift", type=int, default=0, metavar="STEPS",
                        help="with --draft: the GRPO job's STEPS steps, draft trained / frozen")
    args = parser.parse_args()
    if args.draft:
        args.drafts = "draft"
        if args.workloads == parser.get_default("workloads"):
            args.workloads = "1,tail,64"
    path = ensure_model(args.model_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    kinds = ["off"] + args.drafts.split(",")
    options = {"off": {}, "ngram": {"speculative": "ngram"},
               "self": {"speculative": "self",
                        "speculative_self_layers": args.self_layers},
               "draft": {"speculative": "draft"}}
    ctx = mp.get_context("spawn")
    engines = {k: ctx.Pool(1, initializer=_start_engine, initargs=(path, args.dtype, options[k]))
               for k in kinds}
    chosen = workloads(tokenizer, args.workloads, args.temperature, not args.unseeded)
    print(f"model {path}, dtype {args.dtype}, temperature {args.temperature}, "
          f"{'unseeded' if args.unseeded else 'seeded'} requests, "
          f"{args.repeats} timed repeats after one untimed pass")
    for calls in chosen.values():  # the untimed pass: draft lengths learnt per batch size
        for k in kinds:
            engines[k].apply(run, (calls,))
    goals = {"1": ("draft", 1.5) if args.draft else ("self", 1.4), "edit": ("ngram", 2.0),
             "tail": (None, 1.3), "64": (None, 0.97 if args.draft else 0.95)}
    head = "".join(f"{k:>12}" for k in kinds)
    print(f"{'workload':<9}{head}   ratios vs off (goal); kept drafts per verify step, "
          f"kept share, verify share of decode rows")
    for name, calls in chosen.items():
        results: dict[str, list[dict]] = {k: [] for k in kinds}
        for i in range(args.repeats):
            for k in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:
                results[k].append(engines[k].apply(run, (calls,)))
        # one batch for "tail": its wall time is what counts (as batches per second)
        rate = (lambda r: 1 / r["seconds"]) if name == "tail" else (lambda r: r["tok_s"])
        med = {k: statistics.median(map(rate, results[k])) for k in kinds}
        goal_kind, goal = goals.get(name, (None, None))
        notes = []
        runs = {}
        for k in kinds[1:]:
            runs[k] = [rate(a) / rate(b) for a, b in zip(results[k], results["off"], strict=True)]
            ratio = statistics.median(runs[k])
            verify = sum(r["spec_verify_steps"] for r in results[k])
            kept = sum(r["spec_accepted_tokens"] for r in results[k])
            drafted = sum(r["spec_draft_tokens"] for r in results[k])
            tokens = sum(r["tokens"] for r in results[k])
            mark = "" if goal is None or goal_kind not in (None, k) else f" (goal {goal}x)"
            notes.append(f"{k} {ratio:.2f}x{mark} "
                         f"{kept / verify if verify else 0:.2f}/step "
                         f"({(kept + verify) / verify if verify else 0:.2f} tok/verify), "
                         f"{kept / drafted if drafted else 0:.0%} kept, "
                         f"{verify / max(1, tokens - kept):.0%} verify")
        unit = "batch/s" if name == "tail" else "tok/s"
        cols = "".join(f"{med[k]:>12.3f}" if name == "tail" else f"{med[k]:>12.1f}"
                       for k in kinds)
        print(f"{name:<9}{cols}   [{unit}] {'; '.join(notes)}", flush=True)
        print(f"{'':<9}per-repeat ratios: " + "; ".join(
            f"{k} {', '.join(f'{x:.2f}' for x in v)}" for k, v in runs.items()))
    for k in kinds[1:]:
        print(f"{k}: learnt per batch bucket (best length, last tok/s by length): "
              f"{engines[k].apply(lengths_table)}")
    costs = {"1": [([chat(tokenizer, "Write a short story about the ocean.")], [{
        "max_new_tokens": 160, "temperature": args.temperature, "ignore_eos": True,
        "seed": 5}])], "edit": chosen["edit"][:1] if "edit" in chosen else []}
    print("costs at batch 1, draft length pinned: step s / plain step s, drafting s per "
          "drafted token / plain step s, tokens per step")
    for name, calls in costs.items():
        if not calls:
            continue
        plain = engines["off"].apply(run, (calls,))
        base = plain["step_s"] / plain["steps"]
        for k in kinds[1:]:
            cells = []
            for length in (1, 2, 4):
                r = engines[k].apply(pinned, (calls, length))
                cells.append(f"d={length}: {r['step_s'] / r['steps'] / base:.2f}x, "
                             f"{r['spec_draft_s'] / max(1, r['spec_draft_tokens']) / base:.3f}, "
                             f"{r['tokens'] / r['steps']:.2f}")
            print(f"  {name:<5} {k:<6} plain step {base * 1e3:.1f} ms; " + "; ".join(cells),
                  flush=True)
    for pool in engines.values():
        pool.close()
    if args.drift:
        drift(path, args.drift, args.temperature)


def drift(path: str, steps: int, temperature: float) -> None:
    """The GRPO main job for `steps` steps with the learned draft, trained beside the policy and
    frozen: per step, drafted tokens kept per drafted token (the job's spec/draft_acceptance)."""
    from hotswap.rollout.grpo import parse_args, run

    print(f"drift over {steps} GRPO steps: drafted tokens kept per drafted token, per step")
    for name, extra in (("trained", []), ("frozen", ["--freeze-draft"])):
        history = run(parse_args(["--model-path", path, "--steps", str(steps), "--speculative",
                                  "draft", "--quiet", "--temperature", str(temperature)]
                                 + extra))["history"]
        rates = [h.get("spec/draft_acceptance", float("nan")) for h in history]
        seconds = [h.get("time/draft_train_s", 0.0) for h in history]
        train = [h["time/train_s"] for h in history]
        rollout = [h["time/rollout_s"] for h in history]
        measured = [r for r in rates if r == r]  # a step whose rollouts drafted nothing: NaN
        print(f"  {name:<8} " + " ".join(f"{r:.3f}" for r in rates)
              + f"   last 3 measured / first: "
              f"{statistics.mean(measured[-3:]) / measured[0]:.2f}; "
              f"rollout {statistics.mean(rollout):.1f} s/step, train {statistics.mean(train):.1f}"
              f" s/step of which draft {statistics.mean(seconds):.2f}", flush=True)

if __name__ == "__main__":
    main()
