"""Warm start of the learned draft: distil it from the policy's own generations, on CPU.

    python -m hotswap.engine.speculative.train_draft MODEL_PATH [--out DIR] [--minutes 6]
        [--samples N] [--prompts FILE] [--max-new-tokens 128] [--temperature 1.0]
        [--vocab 8192] [--seed 0]

1. sample the policy with the Engine at the temperature (pure sampling), a quarter of the prompts
the task's and the rest written by the policy itself (speculative/draft_data.py); 2. compute its
features F (after the final norm) and the full-vocab logsumexp of its logits with HF
transformers; 3. pick the draft vocabulary: the tokens it emits most, plus EOS; 4. train (10% of
sequences held out) for --minutes, printing loss, one-step acceptance and the k=4 chained
accepted length per epoch; 5. pick the draft's proposal temperature on the held-out sequences
(train_draft.calibrate_proposal); 6. save beside the model (MODEL_PATH/draft). It lives here,
not in speculative/, because it runs the Engine, which sits above speculative/ in the import
order.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import torch

from hotswap.engine.engine import Engine
from hotswap.engine.speculative import draft_data
from hotswap.engine.speculative.draft_data import Sample
from hotswap.engine.speculative.train_draft import (
    DraftTrainer,
    EvalResult,
    calibrate_proposal,
    evaluate,
    policy_weights_sha,
    save_draft,
)

DEFAULT_VOCAB = 8192
EVAL_CHAIN = 4


def sample_rollouts(engine: Engine, prompts: list[list[int]], max_new_tokens: int,
                    temperature: float, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) per prompt, each request seeded: seed + its index."""
    params = [{"temperature": temperature, "max_new_tokens": max_new_tokens, "seed": seed + i}
              for i in range(len(prompts))]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [(p, list(out["output_ids"])) for p, out in zip(prompts, outs)]


def written_prompts(engine: Engine, tokenizer: Any, count: int, temperature: float,
                    seed: int, max_tokens: int = 96) -> list[str]:
    """`count` user messages the policy writes itself (draft_data's module docstring); a
    message cut at `max_tokens` is kept as it is, an empty one is written again."""
    head, close = draft_data.user_turn(tokenizer)
    stop = close[:1]
    texts: list[str] = []
    for attempt in range(4):
        want = count - len(texts)
        if want <= 0:
            break
        params = [{"temperature": temperature, "max_new_tokens": max_tokens,
                   "seed": seed + attempt * count + i, "stop_token_ids": stop}
                  for i in range(want)]
        for out in engine.generate(input_ids=[head] * want, sampling_params=params):
            ids = [t for t in out["output_ids"] if t not in stop]
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            texts += [text] if text else []
    if len(texts) < count:
        raise RuntimeError(f"the policy wrote {len(texts)} non-empty prompts of {count} in four "
                           "rounds: give the task's prompts with --prompts")
    return texts


def build_prompts(engine: Engine, tokenizer: Any, args: argparse.Namespace) -> list[list[int]]:
    """--samples prompts in a seeded order: the task's share, then the policy's own."""
    tasks = round(args.samples * draft_data.TASK_SHARE)
    chats = draft_data.task_chats(tasks, args.seed, args.prompts)
    chats += [[{"role": "user", "content": text}] for text in
              written_prompts(engine, tokenizer, args.samples - tasks, args.temperature,
                              args.seed + 1_000_000)]
    random.Random(args.seed).shuffle(chats)
    return [draft_data.encode_chat(tokenizer, c) for c in chats]


def report(epoch: int, loss: float, result: EvalResult, elapsed: float) -> None:
    steps = " ".join(f"{a:.3f}" for a in result.level_acceptance)
    print(f"epoch {epoch:3d}  loss {loss:7.4f}  held-out accept {result.acceptance:.3f}  "
          f"k={EVAL_CHAIN} accepted {result.chained_length:.3f} (steps {steps})  "
          f"{elapsed:6.1f}s", flush=True)


def train(trainer: DraftTrainer, train_set: list[Sample],
          held_out: list[dict[str, torch.Tensor]], minutes: float, seed: int) -> None:
    """Epochs over `train_set` until `minutes` have passed, reporting the result on the
    `held_out` batches after each."""
    rng = random.Random(seed)
    start, epoch = time.monotonic(), 0

    def held_out_result() -> EvalResult:
        return evaluate(trainer.net, held_out, trainer.head_weight, trainer.embed_weight,
                        trainer.loss_cfg.temperature, k=EVAL_CHAIN)

    report(0, float("nan"), held_out_result(), 0.0)
    while time.monotonic() - start < minutes * 60:
        epoch += 1
        losses = []
        for batch in draft_data.batches(train_set, response_only=False, rng=rng):
            losses.append(trainer.step(batch["input_ids"], batch["features"], None,
                                       batch["loss_mask"], attention_mask=batch["attention_mask"],
                                       lse=batch["lse"])["loss"])
            if time.monotonic() - start >= minutes * 60:
                break
        report(epoch, sum(losses) / max(len(losses), 1), held_out_result(),
               time.monotonic() - start)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hotswap.engine.speculative.train_draft",
                                description="Distil a learned draft from the policy's samples.")
    p.add_argument("model_path")
    p.add_argument("--out", default=None, help="checkpoint folder (default MODEL_PATH/draft)")
    p.add_argument("--minutes", type=float, default=6.0, help="training time")
    p.add_argument("--samples", type=int, default=1024, help="rollouts to distil from")
    p.add_argument("--prompts", default=None,
                   help="JSONL of the task's prompts ({\"messages\": [...]} or {\"prompt\": "
                        "\"...\"} a line): a quarter of the rollouts (default: the GRPO job's "
                        "additions); the policy writes the rest")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help="draft vocabulary size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--levels", type=int, default=2, help="chain steps trained (1: no TTT)")
    p.add_argument("--reg-weight", type=float, default=0.2, help="feature regression weight")
    args = p.parse_args(argv)
    if min(args.samples, args.max_new_tokens, args.vocab, args.levels) < 1 or args.minutes < 0:
        p.error("--samples, --max-new-tokens, --vocab and --levels must be >= 1, --minutes >= 0")
    if args.temperature <= 0:
        p.error("--temperature must be > 0 (the draft is trained for sampling)")
    return args


def warm_start(argv: list[str] | None = None) -> str:
    """Run the warm start; returns the folder the draft was saved to."""
    import transformers

    args = parse_args(argv)
    out = args.out or os.path.join(args.model_path, "draft")
    begin = time.monotonic()
    torch.manual_seed(args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_path)
    with Engine(args.model_path, dtype="float32", seed=args.seed) as engine:
        prompts = build_prompts(engine, tokenizer, args)
        rollouts = sample_rollouts(engine, prompts, args.max_new_tokens, args.temperature,
                                   args.seed)
    print(f"sampled {len(rollouts)} rollouts, {sum(len(r) for _, r in rollouts)} tokens "
          f"({time.monotonic() - begin:.0f}s)", flush=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path,
                                                              dtype=torch.float32).eval()
    data = draft_data.distillation_set(model, rollouts, args.temperature, args.vocab, args.seed)
    print(f"features computed; draft vocabulary {len(data.token_map)} covers "
          f"{data.coverage:.1%} of sampled tokens ({time.monotonic() - begin:.0f}s)", flush=True)
    trainer = DraftTrainer(model, data.token_map, lr=args.lr, temperature=args.temperature,
                           levels=args.levels, reg_weight=args.reg_weight)
    held_out = draft_data.batches(data.held_out, response_only=True)
    train(trainer, data.train, held_out, args.minutes, args.seed)
    scale, result = calibrate_proposal(trainer.net, held_out, trainer.head_weight,
                                       trainer.embed_weight, args.temperature, k=EVAL_CHAIN)
    print(f"proposal scale {scale}: held-out accept {result.acceptance:.3f}  k={EVAL_CHAIN} "
          f"accepted {result.chained_length:.3f}", flush=True)
    save_draft(out, trainer.named_tensors(), data.token_map, model.config.to_dict(),
               trained_tokens=trainer.trained_tokens, policy_path=os.path.abspath(args.model_path),
               weights_sha=policy_weights_sha(model), proposal_scale=scale,
               eval={"acceptance": round(result.acceptance, 4),
                     f"chained_k{EVAL_CHAIN}_accepted": round(result.chained_length, 4),
                     "temperature": args.temperature})
    print(f"saved the draft to {out} ({time.monotonic() - begin:.0f}s in all)")
    print(json.dumps({"out": out, "acceptance": result.acceptance,
                      "chained_k4": result.chained_length, "proposal_scale": scale}))
    return out


if __name__ == "__main__":
    warm_start()
