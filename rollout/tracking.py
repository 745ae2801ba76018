"""Tracker: per-step metrics and sample completions to wandb (offline by default), every step's
metrics as one JSON line in the run's folder (metrics.jsonl, what rollout/plot.py draws), and the
console: a header, then one table row per step, with a progress bar below on a terminal only.

`WANDB_MODE` is respected when set; otherwise the run is written offline under `dir`
(`wandb sync <run dir>` uploads it later). No network is needed.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, TextIO

from hotswap.rollout.trajectory import RolloutBatch
from hotswap.weight_sync.versions import VersionOrder

METRICS_FILE = "metrics.jsonl"  # in the run's folder: one JSON row per step

# Console columns: (metric key, header, width, format spec).
COLUMNS = [
    ("step", "step", 4, ".0f"), ("weight_version", "version", 7, ""),
    ("reward/sampled_mean", "reward", 6, ".3f"), ("reward/mean", "kept r", 6, ".3f"),
    ("reward/task_mean", "task r", 6, ".3f"), ("reward/failures", "fail", 4, ".0f"),
    ("tools/correct", "right", 5, ".2f"), ("tools/call_rate", "calls", 5, ".2f"),
    ("tools/parse_fail_rate", "bad call", 8, ".2f"), ("tools/turns", "turns", 5, ".2f"),
    ("response/length", "len", 5, ".1f"), ("rollout/tokens_per_s", "gen tok/s", 9, ".1f"),
    ("rollout/cache_hit_rate", "cache", 5, ".2f"),
    ("rollout/spec_accept_len", "spec acc", 8, ".2f"),
    ("spec/draft_acceptance", "draft kept", 10, ".3f"),
    ("staleness/version_lag_max", "lag", 3, ".0f"),
    ("mismatch/abs_diff", "|dlogp|", 8, ".1e"), ("mismatch/kl", "kl", 8, ".1e"),
    ("mismatch/tis_truncated", "tis cut", 7, ".3f"),
    ("time/rollout_s", "roll s", 6, ".1f"), ("time/reward_s", "rew s", 5, ".2f"),
    ("time/train_s", "train s", 7, ".1f"), ("time/draft_train_s", "draft s", 7, ".2f"),
    ("time/weight_sync_s", "sync s", 6, ".2f"),
    ("sync/sent_mb", "sent MB", 8, ".1f"),
    ("sync/changed_fraction", "changed", 8, ".2%"),
    ("fleet/replicas", "replicas: requests, tok/s, version, state", 0, ""),
]


class Console:
    """A header, then one row per step in the columns the first row had (a later row leaves a
    missing value blank). The progress bar is drawn only when the stream is a terminal: in a
    file or a pipe its redraws would land between the rows."""

    def __init__(self, total_steps: int | None = None, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.columns: list[tuple[str, str, int, str]] | None = None
        self.bar = None
        if is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, desc="grpo", unit="step", file=self.stream,
                            leave=False, dynamic_ncols=True)

    def write(self, line: str) -> None:
        """A line above the bar (or just the line, without one)."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def row(self, metrics: dict[str, Any]) -> None:
        if self.columns is None:
            self.columns = [c for c in COLUMNS if c[0] in metrics]
            self.write(" ".join(f"{h:>{w}}" for _, h, w, _ in self.columns))
        self.write(" ".join(_fmt(metrics.get(k, ""), w, spec) for k, _, w, spec in self.columns))
        if self.bar is not None:
            self.bar.update(1)
            reward = metrics.get("reward/sampled_mean", metrics.get("reward/mean", math.nan))
            self.bar.set_postfix(reward=f"{reward:.3f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def is_terminal(stream: TextIO | None) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Tracker:
    def __init__(self, project: str = "hotswap", mode: str | None = None, dir: str | None = None,
                 config: dict | None = None, name: str | None = None,
                 total_steps: int | None = None, console: bool = True):
        """console=False: no table and no progress bar (wandb and metrics.jsonl only)."""
        import wandb

        self.mode = mode or os.environ.get("WANDB_MODE") or "offline"
        os.makedirs(dir or ".", exist_ok=True)
        self.run = wandb.init(project=project, mode=self.mode, dir=dir, config=config or {},
                              name=name, reinit="finish_previous",
                              settings=wandb.Settings(console="off", silent=True))
        self._wandb = wandb
        self.table = wandb.Table(columns=["step", "prompt", "completion", "reward",
                                          "weight_versions"])
        self.console = Console(total_steps) if console else None

    @property
    def run_dir(self) -> str:
        """The folder wandb writes this run to (offline: `.../wandb/offline-run-*`)."""
        return os.path.dirname(self.run.dir)

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.run_dir, METRICS_FILE)

    def write(self, line: str) -> None:
        """A line of the job's own, above the progress bar if there is one."""
        if self.console is not None:
            self.console.write(line)
        else:
            print(line, flush=True)

    def log(self, step: int, metrics: dict[str, Any],
            samples: list[tuple[str, str, float, str]] | None = None) -> None:
        """Log one step's metrics; samples: (prompt, completion, reward, versions) rows."""
        for row in samples or []:
            self.table.add_data(step, *row)
        payload = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if samples:
            payload["samples"] = self._wandb.Table(columns=self.table.columns,
                                                   data=self.table.data)
        self.run.log(payload, step=step)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(_json_row({"step": step, **metrics})) + "\n")
        if self.console is not None:
            self.console.row({"step": step, **metrics})

    def finish(self) -> str:
        if self.console is not None:
            self.console.close()
        run_dir = self.run_dir
        self.run.finish()
        return run_dir


def _json_row(metrics: dict[str, Any]) -> dict[str, Any]:
    """Numbers and strings; NaN and infinities as null (plain JSON)."""
    row: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            row[key] = None
        elif isinstance(value, (int, float, str)):
            row[key] = value
    return row


def _fmt(value: Any, width: int, spec: str) -> str:
    try:
        return format(value, f">{width}{spec}")
    except (ValueError, TypeError):
        return f"{value!s:>{width}}"


def batch_metrics(batch: RolloutBatch, engine_version: str | None = None,
                  versions: VersionOrder | None = None) -> dict[str, float]:
    """Reward, length, cache and staleness figures of one batch. Staleness: how many versions
    each token's is behind `engine_version`, counted over `versions` (a TokenClient's, which
    saw every version served) or else over the batch's own versions."""
    rewards = [r for r in batch.rewards if not math.isnan(r)]
    mean = sum(rewards) / len(rewards) if rewards else math.nan
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else math.nan
    lengths = [sum(m) for m in batch.loss_mask]
    out = {"reward/mean": mean, "reward/std": std, "reward/nan_fraction":
           1 - len(rewards) / max(1, len(batch)),
           "response/length": sum(lengths) / max(1, len(lengths)),
           "response/finished_fraction": sum(f == "stop" for f in batch.finish_reason)
           / max(1, len(batch)), "batch/trajectories": float(len(batch))}
    scored = [r for r in batch.meta.get("scored_rewards", []) if not math.isnan(r)]
    if scored:  # every group sampled this step, before the filter kept some
        out["reward/sampled_mean"] = sum(scored) / len(scored)
    out.update(model_reward_metrics(batch.reward_info))
    labels = [v for row in batch.weight_versions for v in row if v is not None]
    if engine_version is not None and labels:
        lags = (versions or VersionOrder()).lags(engine_version, labels)
        out["staleness/version_lag_max"] = float(max(lags))
        out["staleness/version_lag_mean"] = sum(lags) / len(lags)
    stats = batch.meta.get("client_stats")
    if stats and stats.get("prompt_tokens"):
        out["rollout/cache_hit_rate"] = stats["cached_tokens"] / stats["prompt_tokens"]
    if stats and stats.get("spec_verify_steps"):  # drafted tokens kept per verify step
        out["rollout/spec_accept_len"] = stats["spec_accepted_tokens"] / stats["spec_verify_steps"]
    if batch.meta.get("seconds"):
        out["rollout/tokens_per_s"] = sum(len(r) for r in batch.response_ids) / batch.meta[
            "seconds"]
    return out


def model_reward_metrics(infos: list[dict[str, Any]]) -> dict[str, float]:
    """With a judge or reward model (rollout/judges.py): the trajectories whose scoring failed,
    and the mean of the task's own reward kept beside the model's."""
    if not any("score_s" in i for i in infos):
        return {}
    own = [i["task_reward"] for i in infos if not math.isnan(i.get("task_reward", math.nan))]
    out = {"reward/failures": float(sum("failure" in i for i in infos))}
    if own:
        out["reward/task_mean"] = sum(own) / len(own)
    return out


def tool_metrics(scores: list[dict[str, float]]) -> dict[str, float]:
    """Agent figures over trajectories' tool scores ({"tool_calls", "parse_errors", "turns",
    "correct"} each): the share with at least one parsed call, failed / attempted calls (NaN
    when none was attempted), turns per trajectory, the share answered right."""
    n = max(1, len(scores))
    parsed = sum(s["tool_calls"] for s in scores)
    failed = sum(s["parse_errors"] for s in scores)
    return {"tools/call_rate": sum(s["tool_calls"] > 0 for s in scores) / n,
            "tools/parse_fail_rate": failed / (parsed + failed) if parsed + failed else math.nan,
            "tools/turns": sum(s["turns"] for s in scores) / n,
            "tools/correct": sum(s["correct"] for s in scores) / n,
            "tools/trajectories": float(len(scores))}
