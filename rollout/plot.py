"""One picture of a run, for users without a wandb account: per step, the reward, the mismatch
between the trainer's and the engine's logprobs (|dlogp| and kl), generated tokens per second
and the seconds a weight update took, drawn from the rows the Tracker logged (metrics.jsonl).

python -m hotswap.rollout.plot RUN_DIR [--out PNG]

RUN_DIR is the run folder the main job prints (`runs/wandb/offline-run-*`, or
`runs/wandb/latest-run`); the picture goes to RUN_DIR/metrics.png unless --out says otherwise.
Drawn with matplotlib's Agg canvas: no display needed.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from hotswap.rollout.tracking import METRICS_FILE

PLOT_FILE = "metrics.png"
FIGSIZE = (11.0, 7.0)  # inches: 1100 x 700 pixels at DPI
DPI = 100


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]  # (metric key, legend label)
    log: bool = False  # a log y axis when every value drawn is positive
    from_zero: bool = False  # a y axis from 0: noise between steps is not drawn as a trend


PANELS = (
    Panel("reward", "mean reward per sample",
          (("reward/sampled_mean", "all groups sampled"), ("reward/mean", "groups trained on"))),
    Panel("trainer vs engine logprobs", "per sampled token",
          (("mismatch/abs_diff", "|dlogp| (mean abs. difference)"),
           ("mismatch/kl", "kl (k3 estimate)")), log=True),
    Panel("generation speed", "generated tokens / s",
          (("rollout/tokens_per_s", "engine, this step's batch"),), from_zero=True),
    Panel("weight update", "seconds",
          (("time/weight_sync_s", "push into the engine"),), from_zero=True),
)


def read_rows(run_dir: str) -> list[dict[str, Any]]:
    """The rows Tracker.log wrote, one per step."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no logged rows; RUN_DIR is the run folder the job "
                                "printed (runs/wandb/offline-run-*)")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def figure(rows: list[dict[str, Any]], title: str = "") -> Figure:
    """A 2 x 2 grid of panels, the step on every x axis."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    axes = fig.subplots(2, 2, sharex=True)
    for ax, panel in zip(axes.flat, PANELS):
        _draw(ax, panel, rows)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title)
    return fig


def _draw(ax: Axes, panel: Panel, rows: list[dict[str, Any]]) -> None:
    drawn = []
    for key, label in panel.series:
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o", markersize=4, label=label)
            drawn += values
    ax.set_title(panel.title)
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not drawn:
        ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center",
                transform=ax.transAxes, color="gray")
        return
    if panel.log and min(drawn) > 0:
        ax.set_yscale("log")
    if panel.from_zero:
        ax.set_ylim(bottom=0, top=max(drawn) * 1.1 or None)
    if len(panel.series) > 1:
        ax.legend(fontsize="small")


def draw(run_dir: str, out: str | None = None) -> str:
    """Write the picture of the run in run_dir; returns its path."""
    rows = read_rows(run_dir)
    out = out or os.path.join(run_dir, PLOT_FILE)
    name = os.path.basename(os.path.realpath(run_dir))
    figure(rows, f"hotswap GRPO, {len(rows)} steps ({name})").savefig(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hotswap.rollout.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help=f"where the PNG goes (RUN_DIR/{PLOT_FILE})")
    args = p.parse_args(argv)
    try:
        print(draw(args.run_dir, args.out))
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(str(exc)) from None


if __name__ == "__main__":
    main()
