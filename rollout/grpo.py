"""GRPO on a verifiable task: a hotswap engine samples, an HF transformers model trains.

python -m hotswap.rollout.grpo [--steps 10] [--transport tensor|gloo] [--async] ...

Each step: `collect` samples a group per prompt (single-digit addition, exact-match reward on the
last number of the answer), keeps the groups whose rewards differ, and computes GRPO advantages;
the trainer (rollout/trainer.py: each group's prompt computed once, its responses packed on top)
takes one clipped policy-gradient step with the engine's logprobs as the old logprobs; the new
weights are pushed into the running engine (in-process with `update_weights_from_tensor`, or,
with `--transport gloo`, into an engine server process over a gloo group by
`hotswap.weight_sync.WeightSender`). `--fleet ray --replicas N` samples from N
engine replicas on Ray (hotswap.fleet.RayFleet) and pushes to all of them every step, through
Ray's object store or, with `--transport gloo`, one broadcast. `--async` samples the next batch
while the trainer trains (AsyncRollout, staleness bounded by --max-staleness). Metrics go to wandb
(offline unless WANDB_MODE says otherwise), to metrics.jsonl in the run folder, and to the console
as one table row per step (a progress bar too, on a terminal); at the end the run is drawn into
metrics.png beside them (rollout/plot.py), whose path is the last line printed.
`--quantization int8` samples from an int8 engine (the trainer stays float32); `--tis C` then
weights the loss by truncated importance sampling (rollout/importance.py): the PPO ratio is taken
against the trainer's own logprobs and each token weighted by min(pi_trainer / pi_rollout, C).
`--routing-replay` (MoE models, e.g. the folder examples/make_tiny_moe.py writes): the engine
returns every token's experts and the trainer's forward routes to them (rollout/routing_replay.py).
`--task tools` (rollout/tasks.py): multi-digit arithmetic with a `calculator` tool called in the
Hermes format, multi-turn through ToolLoop (tool results in context with loss mask 0); reward 1
when the final answer holds the exact number, else --format-reward for a well-formed call.
`--task shapes` (a vision-language checkpoint: Qwen2-VL, Qwen2.5-VL, Qwen3-VL): each prompt holds
a drawn image of one to four shapes and asks how many; the engine samples with the image, the
trainer scores each sample with HF's VL model and the same image (rollout/vision_forward.py), and
the push carries the vision tower's tensors with the rest.
`--judge PATH` / `--reward-model PATH` (rollout/judges.py): a generative judge's verdict or a
reward model's score replaces the task's reward (which stays in the info and the table as
`task r`); each scorer is an engine of its own that the pushes never reach (engines.py); each
group is scored as soon as it finishes and `rew s` sums the step's scoring seconds.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from hotswap.rollout.advantages import nonzero_std
from hotswap.rollout.client import TokenClient
from hotswap.rollout.collect import collect
from hotswap.rollout.engines import EngineHandle, engine_for, replica_metrics, start_scorer
from hotswap.rollout.importance import MODES
from hotswap.rollout.judges import Combined, judge_reward, model_reward
from hotswap.rollout.plot import draw
from hotswap.rollout.tasks import TASKS, Task, make_task, tool_score
from hotswap.rollout.tasks import addition_rows as addition_rows  # examples and bench use it
from hotswap.rollout.tasks import shapes_rows as shapes_rows  # bench/vlm.py uses it
from hotswap.rollout.tracking import Tracker, batch_metrics, is_terminal, tool_metrics
from hotswap.rollout.trainer import Trainer
from hotswap.rollout.trajectory import RolloutBatch
from hotswap.weight_sync.versions import version_key


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hotswap.rollout.grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", "--model", default=None,
                   help="HF model folder (default: SmolLM2-135M-Instruct, fetched and converted)")
    p.add_argument("--steps", type=int, default=10, help="training steps (weight pushes)")
    p.add_argument("--prompts", type=int, default=8, help="groups per training batch")
    p.add_argument("--group-size", type=int, default=6, help="samples per prompt (GRPO's G)")
    p.add_argument("--over-sample", type=int, default=4,
                   help="extra groups started per batch; groups whose rewards are all equal "
                        "are filtered out and replaced")
    p.add_argument("--filter", choices=["nonzero_std", "none"], default="nonzero_std",
                   help="which groups a batch keeps (nonzero_std: rewards that differ)")
    p.add_argument("--task", choices=TASKS, default="addition",
                   help="addition: single-digit sums, one turn; tools: multi-digit arithmetic "
                        "with a calculator tool, multi-turn (ToolLoop); shapes: count the "
                        "shapes drawn in an image (vision-language models)")
    p.add_argument("--max-turns", type=int, default=3,
                   help="--task tools: assistant turns per trajectory")
    p.add_argument("--format-reward", type=float, default=0.1,
                   help="--task tools: the reward of a wrong final answer from a trajectory "
                        "with at least one well-formed tool call and no malformed one (a right "
                        "answer scores 1; 0 turns the shaping off)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="per turn (default 16 for addition, 48 for tools)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip epsilon")
    p.add_argument("--micro-batch", type=int, default=64,
                   help="sequences per forward/backward, packed with their group's prompt "
                        "(rollout/trainer.py); the default takes the demo's batch in one")
    p.add_argument("--micro-positions", type=int, default=4096,
                   help="at most this many packed positions per forward/backward (bounds the "
                        "trainer's memory: ~1.2 MB a position for SmolLM2 in fp32)")
    p.add_argument("--transport", choices=["tensor", "gloo"], default="tensor",
                   help="tensor: engine in this process, update_weights_from_tensor; gloo: "
                        "engine server in its own process, WeightSender over a gloo group")
    p.add_argument("--fleet", choices=["none", "ray"], default="none",
                   help="ray: --replicas engine replicas as Ray actors (pip install "
                        "'hotswap[ray]'), one weight version for all")
    p.add_argument("--replicas", type=int, default=2, help="--fleet ray: engine replicas")
    p.add_argument("--async", dest="async_mode", action="store_true",
                   help="sample the next batch while training (AsyncRollout)")
    p.add_argument("--max-staleness", type=int, default=1,
                   help="--async: trainable tokens at most this many versions old")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb-project", default="hotswap-grpo")
    p.add_argument("--wandb-dir", default="runs", help="where the wandb run is written")
    p.add_argument("--samples-per-step", type=int, default=4,
                   help="completions logged to the wandb samples table per step")
    p.add_argument("--dtype", default="float32", help="engine and trainer dtype")
    p.add_argument("--max-total-tokens", type=int, default=16384,
                   help="engine KV pool in tokens (small: the trainer shares the memory)")
    p.add_argument("--delta-updates", action="store_true",
                   help="push only the weights' elements that changed in the engine's dtype "
                        "(full when a delta does not pay or is refused)")
    p.add_argument("--quiet", action="store_true",
                   help="no table and no progress bar (the job's own lines still print)")
    p.add_argument("--quantization", choices=["int8"], default=None,
                   help="int8: the engine samples with int8 weights x int8 activations (CPU)")
    p.add_argument("--tis", type=float, default=None, metavar="C",
                   help="importance-sampling correction of the rollout/trainer mismatch: "
                        "token weights min(ratio, C) (rollout/importance.py)")
    p.add_argument("--tis-mode", choices=MODES, default="token",
                   help="--tis: token (truncated) or sequence (drop sequences whose ratio "
                        "leaves [1/C, C])")
    p.add_argument("--speculative", choices=["ngram", "self", "draft"], default=None,
                   help="speculative decoding in the engine (docs/api.md#speculative-decoding); "
                        "the table's 'spec acc' column: drafted tokens kept per verify step. "
                        "draft: the learned draft in MODEL/draft (python -m "
                        "hotswap.engine.speculative.train_draft MODEL makes it), trained beside "
                        "the policy and pushed with it")
    p.add_argument("--freeze-draft", action="store_true",
                   help="--speculative draft: keep the warm-start draft (no training, no push "
                        "of its tensors: it goes stale)")
    p.add_argument("--exact-logprobs", action="store_true",
                   help="deterministic (batch-invariant) engine and the trainer's exact forward: "
                        "its logprobs equal the engine's bit for bit, |dlogp| = 0 "
                        "(rollout/exact_forward.py)")
    p.add_argument("--routing-replay", action="store_true",
                   help="MoE models: the engine returns every token's experts and the "
                        "trainer's forward routes to them (rollout/routing_replay.py)")
    p.add_argument("--judge", default=None, metavar="PATH",
                   help="a generative judge (any chat model; the policy's own checkpoint too): "
                        "its verdict, correct or incorrect (1/0) against the row's answer, "
                        "replaces the task's reward; a separate engine no push reaches "
                        "(rollout/judges.py)")
    p.add_argument("--reward-model", default=None, metavar="PATH",
                   help="a *ForSequenceClassification checkpoint: its score of the chat "
                        "replaces the task's reward (with --judge: added to the verdict)")
    p.add_argument("--judge-timeout", type=float, default=60.0,
                   help="seconds per scoring call of --judge/--reward-model (one retry)")
    args = p.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 48 if args.task == "tools" else 16
    if min(args.steps, args.prompts, args.group_size, args.max_new_tokens, args.replicas,
           args.max_turns) < 1:
        raise SystemExit("--steps, --prompts, --group-size, --max-new-tokens, --replicas and "
                         "--max-turns must be >= 1")
    if args.tis is not None and not args.tis > 1:
        raise SystemExit("--tis C needs C > 1")
    if args.exact_logprobs and (args.routing_replay or args.quantization):
        raise SystemExit("--exact-logprobs computes the engine's own logprobs and routes: "
                         "without --routing-replay or --quantization")
    return args


def batches(args: argparse.Namespace, client: TokenClient, task: Task, reward: Any
            ) -> Iterator[RolloutBatch]:
    """Synchronous batches: each one sampled from the current weights after the last push."""
    rows_per_batch = args.prompts + args.over_sample * 3
    for step in range(args.steps):
        rows = task.rows(rows_per_batch, seed=args.seed * 100_003 + step)
        batch = collect(client, task.loop, rows, group_size=args.group_size, reward=reward,
                        filter=group_filter(args), target_groups=args.prompts,
                        over_sample=args.over_sample, seed=args.seed + step)
        _take_stats(client, reward, batch)
        yield batch


def group_filter(args: argparse.Namespace) -> Any:
    return nonzero_std() if args.filter == "nonzero_std" else None


def _take_stats(client: TokenClient, reward: Any, batch: RolloutBatch) -> None:
    """The client's counters and, from a reward that tallies them (the tools task), every
    scored trajectory's tool figures since the last batch, into batch.meta."""
    batch.meta["client_stats"] = dict(client.stats)
    for k in client.stats:
        client.stats[k] = 0
    tally = getattr(reward, "task_reward", None) or reward  # Combined keeps the task's
    if hasattr(tally, "take"):
        batch.meta["tool_scores"] = tally.take()


def samples_table(batch: RolloutBatch, tokenizer: Any, count: int
                  ) -> list[tuple[str, str, float, str]]:
    rows = []
    for traj in batch.trajectories[:count]:
        prompt = message_text(traj.row["messages"][-1]) if "messages" in traj.row else ""
        versions = ",".join(sorted({v for v in traj.versions if v is not None}, key=version_key))
        rows.append((prompt, tokenizer.decode(traj.response_ids, skip_special_tokens=True),
                     float(traj.reward), versions))
    return rows


def message_text(message: dict) -> str:
    """A chat message's text; a list of parts (text and images) reads "<image>" per image."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") if part.get("type") == "text" else "<image>"
                   for part in content)


def run(args: argparse.Namespace, reward: Any = None) -> dict[str, Any]:
    """Train; returns the per-step metrics, the wandb run folder and the plot's path. reward:
    default the task's (exact match of the addition's answer; the tools task's ToolReward)."""
    from hotswap.engine.models.fetch import ensure_model

    torch.manual_seed(args.seed)
    if not is_terminal(sys.stderr):  # a log: no model-loading bars from transformers in it
        hf_logging.disable_progress_bar()
    path = ensure_model(args.model_path)
    started = time.perf_counter()
    history: list[dict[str, Any]] = []
    with ExitStack() as engines:
        handle = engines.enter_context(engine_for(args, path))
        client = TokenClient(handle.backend, tokenizer=path, sampling={
            "temperature": args.temperature, "max_new_tokens": args.max_new_tokens},
            routed_experts=args.routing_replay)
        trainer = Trainer(path, args.lr, args.clip, args.temperature, args.micro_batch,
                          args.dtype, pad_id=client.tokenizer.pad_token_id or 0, tis=args.tis,
                          tis_mode=args.tis_mode, micro_positions=args.micro_positions,
                          exact=args.exact_logprobs, draft=draft_trainer(args, path))
        tracker = Tracker(project=args.wandb_project, dir=args.wandb_dir, config=vars(args),
                          total_steps=args.steps, console=not args.quiet)
        fleet = (f", {args.replicas} Ray replicas" if args.fleet == "ray" else "")
        fleet += f", {args.quantization} rollouts" if args.quantization else ""
        fleet += f", TIS C={args.tis:g} ({args.tis_mode})" if args.tis is not None else ""
        fleet += ", routing replay" if args.routing_replay else ""
        fleet += ", exact logprobs (deterministic engine)" if args.exact_logprobs else ""
        fleet += f", tools task (<= {args.max_turns} turns)" if args.task == "tools" else ""
        fleet += ", shapes task (images)" if args.task == "shapes" else ""
        fleet += f", judge {os.path.basename(args.judge)}" if args.judge else ""
        fleet += (f", reward model {os.path.basename(args.reward_model)}" if args.reward_model
                  else "")
        tracker.write(f"hotswap GRPO: {os.path.basename(path)}, transport {args.transport}"
                      f"{fleet}{', async' if args.async_mode else ''}, {args.prompts} groups x "
                      f"{args.group_size} per step, wandb {tracker.mode} -> {tracker.run_dir}")
        task = make_task(args.task, args.max_new_tokens, args.max_turns, args.format_reward)
        reward = model_rewards(args, engines, reward or task.reward)
        source = (async_batches if args.async_mode else batches)(args, client, task, reward)
        replicas: dict[int, dict] = {}
        for step, batch in enumerate(source):
            metrics = train_and_push(args, step, batch, trainer, handle, client)
            if args.fleet == "ray":
                extra, replicas = replica_metrics(handle.backend, replicas,
                                                  metrics["time/rollout_s"])
                metrics.update(extra)
            history.append(metrics)
            tracker.log(step, metrics, samples_table(batch, client.tokenizer,
                                                     args.samples_per_step))
            if step + 1 >= args.steps:
                break
        source.close()
        run_dir = tracker.finish()
    wall = time.perf_counter() - started
    key = "reward/sampled_mean" if "reward/sampled_mean" in history[0] else "reward/mean"
    print(f"done in {wall:.0f} s; final weight version {args.steps}; mean reward of all sampled "
          f"groups: first 3 steps {_mean(h.get(key, math.nan) for h in history[:3]):.3f}, "
          f"last 3 steps {_mean(h.get(key, math.nan) for h in history[-3:]):.3f}")
    print(f"wandb run ({tracker.mode}) written to {run_dir}")
    plot = draw(run_dir)
    print(f"plot written to {plot}", flush=True)
    return {"history": history, "run_dir": run_dir, "wall_s": wall, "plot": plot}


def draft_trainer(args: argparse.Namespace, path: str) -> Any:
    """--speculative draft: how the Trainer makes the DraftTrainer of MODEL/draft (None: the
    draft is not trained, with --freeze-draft or another --speculative)."""
    if args.speculative != "draft" or args.freeze_draft:
        return None
    from hotswap.engine.speculative.train_draft import DraftTrainer, load_draft

    def make(model: torch.nn.Module) -> DraftTrainer:
        net, config = load_draft(os.path.join(path, "draft"), model.config)
        return DraftTrainer(model, config["token_map"], temperature=args.temperature, net=net)

    return make


def model_rewards(args: argparse.Namespace, engines: ExitStack, own: Any) -> Any:
    """--judge and --reward-model: the reward that asks their engines (closed with `engines`),
    `own` kept beside it in the info as "task_reward"; without them, `own`."""
    parts: dict[str, Any] = {}
    if args.judge:
        judge = engines.enter_context(start_scorer(args.judge, args))
        parts["judge"] = judge_reward(judge, timeout_s=args.judge_timeout)
    if args.reward_model:
        model = engines.enter_context(start_scorer(args.reward_model, args))
        parts["reward_model"] = model_reward(model, timeout_s=args.judge_timeout)
    return Combined(parts, own) if parts else own


def train_and_push(args: argparse.Namespace, step: int, batch: RolloutBatch, trainer: Trainer,
                   handle: EngineHandle, client: TokenClient) -> dict[str, Any]:
    label = client.weight_version()
    # A number to plot: the pushes since the oldest version the client saw (the job's own
    # labels "0", "1", ...: the label's number).
    metrics: dict[str, Any] = {"weight_version": client.versions.lag(label,
                                                                     client.versions.labels[0]),
                               **batch_metrics(batch, label, client.versions)}
    if args.task == "tools":
        scores = batch.meta.get("tool_scores")  # every sampled trajectory, kept or filtered
        metrics.update(tool_metrics(scores if scores is not None else
                                    [tool_score(t) for t in batch.trajectories]))
    metrics["time/rollout_s"] = batch.meta.get("wait_s", batch.meta.get("seconds", math.nan))
    metrics["time/reward_s"] = batch.meta.get("reward_s", math.nan)
    start = time.perf_counter()
    if len(batch):  # every group filtered out and no rows left: nothing to learn from
        metrics.update(trainer.step(batch))
    metrics["time/train_s"] = time.perf_counter() - start
    if args.speculative == "draft":
        metrics.update(draft_state(handle.backend))
    start = time.perf_counter()
    pushed = handle.push(trainer.named_weights(), str(step + 1))
    metrics["time/weight_sync_s"] = time.perf_counter() - start
    metrics["sync/sent_mb"] = pushed["bytes"] / 1e6
    metrics["sync/delta"] = float(pushed["kind"] == "delta")
    if "changed_fraction" in pushed:
        metrics["sync/changed_fraction"] = float(pushed["changed_fraction"])
    groups = batch.meta.get("groups", {})
    metrics["batch/groups_filtered"] = float(groups.get("filtered", 0))
    return metrics


def draft_state(backend: Any) -> dict[str, float]:
    """An in-process engine's learned draft before the push: drafted tokens kept per drafted
    token since the last push (its acceptance window restarts with every update) and whether
    it is stale; nothing where the backend does not report its load."""
    get_load = getattr(backend, "get_load", None)
    spec = (get_load() if callable(get_load) else {}).get("speculative") or {}
    if "draft_version" not in spec:
        return {}
    acceptance = spec["acceptance"]
    return {"spec/draft_acceptance": math.nan if acceptance is None else acceptance,
            "spec/draft_stale": float(spec["stale"])}


def async_batches(args: argparse.Namespace, client: TokenClient, task: Task, reward: Any
                  ) -> Iterator[RolloutBatch]:
    from hotswap.rollout.async_rollout import AsyncRollout

    rows = task.rows(args.prompts * (args.steps + 4) * 2, seed=args.seed)
    runner = AsyncRollout(client, task.loop, rows, group_size=args.group_size,
                          batch_groups=args.prompts, reward=reward, filter=group_filter(args),
                          max_staleness=args.max_staleness, seed=args.seed)
    runner.start()
    try:
        while True:
            start = time.perf_counter()
            batch = runner.get_batch()
            batch.meta["wait_s"] = time.perf_counter() - start
            _take_stats(client, reward, batch)
            yield batch
    finally:
        runner.stop()


def _mean(values: Any) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("WANDB_MODE", "offline")
    run(parse_args(argv))


if __name__ == "__main__":
    main()
