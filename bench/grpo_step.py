"""Where one trainer step of `python -m hotswap.rollout.grpo` goes: old (padded) vs new (packed)
[vs exact (--exact-logprobs)].

python bench/grpo_step.py [--model models/smollm2-135m-instruct] [--reps 3] [--threads N]
                          [--max-new-tokens 16] [--exact] [--dtype float32]

One batch shaped like the job's (8 addition prompts in the chat template x 6 responses of 8-16
tokens, the engine's logprobs stood in for by the trainer's own), then per repetition an old
step and a new step, alternating, each split into stages:
- forward: the decoder over the micro-batch's positions;
- head+logsoftmax: the LM head, the log-softmax and the gather of the response tokens;
- loss: the clipped surrogate (rollout/trainer.py's Trainer.step);
- backward.head / backward.decoder: up to the decoder's output gradient / the rest;
- optimizer: clip_grad_norm_ and AdamW.
old: one left-padded row per sample, full-vocabulary logits at every position, then the
response slice, micro-batches of 16 rows, AdamW's default per-tensor loop (rollout/grpo.py
before issue 38). new: rollout/trainer.py (a group's prompt once with its responses packed on
top, the head on trainable positions only, the job's default micro-batch, fused AdamW). exact
(--exact): new's units and step through rollout/exact_forward.py (the engine's batch-invariant
kernels forward, torch backward), as --exact-logprobs runs it; exact/new is its cost.
Medians over --reps of wall seconds, and of the step's CPU seconds (user + system). The
machine may be shared: old and new run alternately so both see the same load; on a loaded
machine OpenMP's spin-waits inflate both wall and CPU time, and `--threads 1` gives the
steadier CPU figures.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from hotswap.rollout.exact_forward import segment_sequences
from hotswap.rollout.grpo import parse_args
from hotswap.rollout.trainer import (
    Trainer,
    micro_batches,
    pack,
    packed_hidden,
    token_logprobs,
)
from hotswap.rollout.trajectory import RolloutBatch, Trajectory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("forward", "head+logsoftmax", "loss", "backward.head", "backward.decoder",
          "optimizer")


def job_batch(path: str, prompts: int, group: int, seed: int, longest: int) -> RolloutBatch:
    from transformers import AutoTokenizer

    from hotswap.rollout.grpo import addition_rows

    tok = AutoTokenizer.from_pretrained(path)
    rng = random.Random(seed)
    trajs = []
    for g, row in enumerate(addition_rows(prompts, seed)):
        prompt = tok.apply_chat_template(row["messages"], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        for s in range(group):
            resp = [rng.randrange(100, 20000) for _ in range(rng.randint(longest // 2, longest))]
            trajs.append(Trajectory(prompt_ids=list(prompt), response_ids=resp,
                                    loss_mask=[1] * len(resp), logprobs=[0.0] * len(resp),
                                    versions=["0"] * len(resp), reward=float(rng.random() < .4),
                                    group_id=g, sample_idx=s))
    advantages = [rng.choice([-1.0, 1.0]) for _ in trajs]
    return RolloutBatch.from_trajectories(trajs, advantages)


def old_parts(batch: RolloutBatch, t: dict, size: int) -> list[Callable]:
    """The old step's micro-batches: each a function returning (hidden, logp [rows, r_len],
    part) with its stages timed."""
    def run(lo: int, model: torch.nn.Module, temperature: float, clock: Clock):
        part = {k: v[lo: lo + size] for k, v in t.items()}
        ids = torch.cat([part["prompt_ids"], part["response_ids"]], dim=1)
        attn = part["attention_mask"]
        positions = (attn.cumsum(1) - 1).clamp(min=0)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attn,
                                     position_ids=positions).last_hidden_state
        clock.lap("forward")
        logits = model.get_output_embeddings()(hidden)
        p_len, r_len = part["prompt_ids"].shape[1], part["response_ids"].shape[1]
        logits = logits[:, p_len - 1: p_len + r_len - 1].float() / temperature
        logp = torch.log_softmax(logits, -1).gather(2, part["response_ids"][..., None])[..., 0]
        clock.lap("head+logsoftmax")
        return hidden, logp, part
    return [lambda m, temp, c, lo=lo: run(lo, m, temp, c) for lo in range(0, len(batch), size)]


def new_parts(batch: RolloutBatch, t: dict, trainer: Trainer) -> list[Callable]:
    def run(units: list[list[int]], model: torch.nn.Module, temperature: float, clock: Clock):
        part = {k: v[torch.tensor([i for u in units for i in u])] for k, v in t.items()}
        packed = pack(batch, units, trainer.pad_id, model.dtype)
        hidden = packed_hidden(model, packed)
        clock.lap("forward")
        flat = token_logprobs(model, hidden, packed, temperature)
        logp = torch.zeros(part["loss_mask"].shape).index_put((packed.row, packed.col), flat)
        clock.lap("head+logsoftmax")
        return hidden, logp, part
    units = micro_batches(trainer.units(batch), trainer.micro_batch)
    return [lambda m, temp, c, u=u: run(u, m, temp, c) for u in units]


def exact_parts(batch: RolloutBatch, t: dict, trainer: Trainer) -> list[Callable]:
    def run(units: list[list[int]], model: torch.nn.Module, temperature: float, clock: Clock):
        part = {k: v[torch.tensor([i for u in units for i in u])] for k, v in t.items()}
        packed = pack(batch, units, trainer.pad_id, model.dtype)
        seqs, index = segment_sequences(packed.input_ids, packed.position_ids, packed.segments)
        hidden = trainer.exact.hidden(seqs)
        clock.lap("forward")
        flat = trainer.exact.head_logprobs(hidden[index.flatten()[packed.source]],
                                           packed.target, temperature)
        logp = torch.zeros(part["loss_mask"].shape).index_put((packed.row, packed.col), flat)
        clock.lap("head+logsoftmax")
        return hidden, logp, part
    units = micro_batches(trainer.units(batch), trainer.micro_batch)
    return [lambda m, temp, c, u=u: run(u, m, temp, c) for u in units]


class Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.last = time.perf_counter()
        self.cpu = time.process_time()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] += now - self.last
        self.last = now


def timed_step(trainer: Trainer, batch: RolloutBatch, parts: list[Callable],
               optim: torch.optim.Optimizer) -> dict[str, float]:
    """Trainer.step's computation (no TIS), stage by stage."""
    model, clock = trainer.model, Clock()
    total = sum(map(sum, batch.loss_mask))
    optim.zero_grad()
    for run in parts:
        hidden, logp, part = run(model, trainer.temperature, clock)
        ratio = torch.exp(logp - part["behavior_logprobs"])
        adv = part["advantages"][:, None]
        surrogate = torch.minimum(ratio * adv,
                                  ratio.clamp(1 - trainer.clip, 1 + trainer.clip) * adv)
        loss = -(surrogate * part["loss_mask"]).sum() / total
        clock.lap("loss")
        hidden.register_hook(lambda _g: clock.lap("backward.head"))
        loss.backward()
        clock.lap("backward.decoder")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    clock.lap("optimizer")
    return {**clock.seconds, "cpu": time.process_time() - clock.cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="responses of half this to this many tokens")
    p.add_argument("--micro-batch", type=int, default=parse_args([]).micro_batch,
                   help="new: the job's --micro-batch (old: 16 rows)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--exact", action="store_true", help="also the exact forward's step")
    p.add_argument("--dtype", default="float32", help="the trainer's dtype")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    batch = job_batch(args.model, args.prompts, args.group_size, 0, args.max_new_tokens)
    trainer = Trainer(args.model, lr=1e-5, clip=0.2, temperature=1.0,
                      micro_batch=args.micro_batch, dtype=args.dtype, pad_id=2, exact=args.exact)
    params = list(trainer.model.parameters())
    optims = {"old": torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=False),
              "new": trainer.optim}
    if args.exact:
        optims["exact"] = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)
    units = trainer.units(batch)
    with torch.no_grad():  # the engine's logprobs: the trainer's own (ratio 1, as in the job)
        logp = torch.zeros(len(batch), max(map(len, batch.response_ids)))
        logp[[i for u in units for i in u]] = trainer.response_logprobs(batch, units,
                                                                        logp.shape[1], {})
    batch.behavior_logprobs = [logp[i, :len(r)].tolist()
                               for i, r in enumerate(batch.response_ids)]
    t = batch.to_tensors(trainer.pad_id)
    variants = {"old": old_parts(batch, t, 16),
                "new": new_parts(batch, t, trainer)}
    if args.exact:
        variants["exact"] = exact_parts(batch, t, trainer)
    packed = [pack(batch, u, 2) for u in micro_batches(units, args.micro_batch)]
    print(f"batch: {len(batch)} rows, {sum(map(sum, batch.loss_mask))} trainable tokens; "
          f"decoder positions: old {t['attention_mask'].numel()}, new "
          f"{sum(pk.input_ids.numel() for pk in packed)}; head rows: old "
          f"{t['attention_mask'].numel()}, new {sum(len(pk.source) for pk in packed)}; "
          f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}",
          flush=True)
    for name in variants:  # warm-up, and AdamW's state for both optimizers
        timed_step(trainer, batch, variants[name], optims[name])
    times: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for rep in range(args.reps):
        for name, parts in variants.items():
            times[name].append(timed_step(trainer, batch, parts, optims[name]))
            print(f"rep {rep} {name}: {step_seconds(times[name][-1]):.2f} s", file=sys.stderr,
                  flush=True)
    ratios = [("old", "new")] + ([("exact", "new")] if args.exact else [])
    print(f"{'stage':<18}" + "".join(f"{name + ' s':>9}" for name in variants)
          + "".join(f"{a + '/' + b:>11}" for a, b in ratios))
    for stage in (*STAGES, "step", "cpu"):
        med = {name: statistics.median(step_seconds(r) if stage == "step" else r.get(stage, 0.0)
                                       for r in times[name]) for name in variants}
        print(f"{stage:<18}" + "".join(f"{med[name]:>9.3f}" for name in variants)
              + "".join(f"{med[a] / med[b] if med[b] else float('nan'):>10.2f}x"
                        for a, b in ratios))


def step_seconds(times: dict[str, float]) -> float:
    return sum(v for k, v in times.items() if k != "cpu")


if __name__ == "__main__":
    main()
