"""Reward-model scoring: hotswap's `classify` vs an HF AutoModelForSequenceClassification forward.

python bench/reward.py [--repeats 3] [--prompts 8] [--responses 8] [--dtype float32]

The reward model is made from the policy: SmolLM2-135M-Instruct's decoder with a seeded random
`score` head (hidden -> 1, `torch.manual_seed(--seed)`), saved as a LlamaForSequenceClassification
checkpoint into a temporary folder, so the bench runs offline; the scores mean nothing, the
compute is a real reward model's. The batch is a GRPO step's: 8 prompts (a ~250-token system
prompt and a question each, in the chat template) x 8 responses of 24-72 tokens each, 64
conversations. hotswap scores each group of 8 in one `classify` call, as `model_reward` does, the
8 calls at once; HF runs one forward over the 64 right-padded sequences. Each repeat starts
from an empty prefix cache and runs both, one after the other, so a slow period of this shared
machine hits both; medians and the ratio are printed, with the cache hit rate (cached tokens over
prompt tokens, from each output's meta_info) and the largest score difference against HF.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import transformers

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model

SYSTEM = ("You are a careful math tutor. Read the problem, reason step by step in short "
          "sentences, check each step, and end with the final answer on its own line as "
          "'Answer: <number>'. Do not skip steps, do not guess, and say so if the problem is "
          "ambiguous. ")
WORDS = ["so", "we", "add", "the", "two", "numbers", "and", "carry", "one", "then", "check",
         "sum", "again", "because", "tens", "column", "changes", "result", "of", "last", "step",
         "which", "gives"]


def make_reward_model(policy: str, out: str, seed: int) -> str:
    """The policy's decoder with a seeded random score head, saved as a reward model."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        policy, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = model.config.eos_token_id
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(policy).save_pretrained(out)
    return out


def conversations(tokenizer, prompts: int, responses: int, seed: int) -> list[list[int]]:
    """prompts x responses chats as ids, the responses of a prompt adjacent."""
    rng = random.Random(seed)
    system = SYSTEM * 4
    out = []
    for i in range(prompts):
        question = f"A shop sells {i + 3} boxes of {7 * i + 5} pencils. How many pencils?"
        for _ in range(responses):
            reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
            chat = [{"role": "system", "content": system}, {"role": "user", "content": question},
                    {"role": "assistant", "content": reply}]
            ids = tokenizer.apply_chat_template(chat, tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def hotswap_scores(engine: Engine, batch: list[list[int]], group: int
                   ) -> tuple[list[float], float, float]:
    """Scores, seconds and cache hit rate of the groups' calls, sent at once from an empty
    cache."""
    engine.flush_cache()
    groups = [batch[i: i + group] for i in range(0, len(batch), group)]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(groups)) as pool:
        outs = [o for part in pool.map(lambda g: engine.classify(input_ids=g), groups)
                for o in part]
    seconds = time.perf_counter() - start
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    total = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    return [o["scores"][0] for o in outs], seconds, cached / total


@torch.no_grad()
def hf_scores(model, batch: list[list[int]]) -> tuple[list[float], float]:
    """One forward over the right-padded batch (padded with an id no sequence holds, so HF's
    last non-pad token is each sequence's own last one)."""
    fill = model.config.vocab_size - 1
    width = max(map(len, batch))
    ids = torch.tensor([s + [fill] * (width - len(s)) for s in batch])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch])
    model.config.pad_token_id = fill
    start = time.perf_counter()
    logits = model(input_ids=ids, attention_mask=mask).logits
    return logits[:, 0].tolist(), time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="the policy (default SmolLM2-135M)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--responses", type=int, default=8, help="per prompt (a GRPO group)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    transformers.logging.set_verbosity_error()  # the new score head's "MISSING" report
    with tempfile.TemporaryDirectory(prefix="hotswap-rm-") as folder:
        path = make_reward_model(ensure_model(args.model_path), folder, args.seed)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        batch = conversations(tokenizer, args.prompts, args.responses, args.seed)
        lengths = sorted(map(len, batch))
        print(f"{len(batch)} conversations, {lengths[0]}-{lengths[-1]} tokens "
              f"({sum(lengths)} in all), torch threads {torch.get_num_threads()}")
        hf = transformers.AutoModelForSequenceClassification.from_pretrained(
            path, dtype=getattr(torch, args.dtype)).eval()
        engine = Engine(path, dtype=args.dtype, max_total_tokens=max(16384, 2 * sum(lengths)))
        try:
            hotswap_scores(engine, batch[: args.responses], args.responses)  # warm-up
            ours, theirs, hits, diff = [], [], [], 0.0
            for repeat in range(args.repeats):
                scores, seconds, hit = hotswap_scores(engine, batch, args.responses)
                ref, ref_seconds = hf_scores(hf, batch)
                ours.append(seconds)
                theirs.append(ref_seconds)
                hits.append(hit)
                diff = max(diff, max(abs(a - b) for a, b in zip(scores, ref)))
                print(f"repeat {repeat}: hotswap {seconds:.2f} s, HF {ref_seconds:.2f} s, "
                      f"ratio {ref_seconds / seconds:.2f}x, cache hit rate {hit:.2f}")
        finally:
            engine.shutdown()
    ratio = statistics.median(theirs) / statistics.median(ours)
    print(f"median: hotswap {statistics.median(ours):.2f} s, HF {statistics.median(theirs):.2f} "
          f"s for {len(batch)} scores: {ratio:.2f}x (goal >= 3x); cache hit rate "
          f"{statistics.median(hits):.2f}; max |score - HF| {diff:.2e}")


if __name__ == "__main__":
    main()
