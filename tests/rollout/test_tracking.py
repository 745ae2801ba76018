"""The console of the main job: a clean table in a file or a pipe, the progress bar on a terminal
only; and the rows the Tracker logs to metrics.jsonl."""

from __future__ import annotations

import io
import json
import math

import pytest
from fixtures import write_tiny_chat_model

from hotswap.rollout.grpo import parse_args, run
from hotswap.rollout.tracking import Console, Tracker

STEPS = [
    {"step": 0, "weight_version": 0, "reward/sampled_mean": 0.25, "reward/mean": 0.5,
     "rollout/tokens_per_s": 321.5, "mismatch/abs_diff": 9.2e-6, "time/weight_sync_s": 0.06},
    {"step": 1, "weight_version": 1, "reward/sampled_mean": 0.5, "reward/mean": 0.75,
     "rollout/tokens_per_s": 300.0, "mismatch/abs_diff": math.nan, "time/weight_sync_s": 0.07},
    # no mismatch this step (nothing trained), and a key the first row did not have
    {"step": 2, "weight_version": 2, "reward/sampled_mean": 0.75, "reward/mean": 1.0,
     "rollout/tokens_per_s": 280.25, "time/weight_sync_s": 0.05, "sync/sent_mb": 538.1},
]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def check_table(lines: list[str], steps: int) -> None:
    """A header, then one row per step under it, cell for cell; nothing else."""
    header, rows = lines[0], lines[1:]
    assert header.split()[:2] == ["step", "version"]
    assert len(rows) == steps
    for step, row in enumerate(rows):
        assert len(row) == len(header)  # every cell in its column
        assert row.split()[:2] == [str(step), str(step)]


def test_in_a_file_the_console_is_a_table_without_a_bar():
    out = io.StringIO()
    console = Console(total_steps=3, stream=out)
    console.write("hotswap GRPO: a line of the job's own")
    for metrics in STEPS:
        console.row(metrics)
    console.close()
    text = out.getvalue()
    assert console.bar is None and "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines[0] == "hotswap GRPO: a line of the job's own"
    check_table(lines[1:], 3)
    assert "sent MB" not in lines[1]  # the columns are the first row's
    assert lines[2].split()[2:] == ["0.250", "0.500", "321.5", "9.2e-06", "0.06"]
    assert lines[4].split()[2:] == ["0.750", "1.000", "280.2", "0.05"]  # mismatch left blank


def test_on_a_terminal_the_bar_counts_the_steps_below_the_rows():
    out = Terminal()
    console = Console(total_steps=3, stream=out)
    for metrics in STEPS:
        console.row(metrics)
    assert console.bar is not None and console.bar.n == 3
    console.close()
    text = out.getvalue()
    assert "3/3" in text and "\r" in text  # the bar redrew itself in place
    # the rows themselves are whole lines: what the bar drew is cleared before each one
    rows = [line.split("\r")[-1] for line in text.split("\n") if line.strip(" \r")]
    assert [r.split()[0] for r in rows[1:4]] == ["0", "1", "2"]


def test_the_tracker_logs_every_step_as_a_json_row(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    tracker = Tracker(project="test", dir=str(tmp_path), total_steps=3)
    for metrics in STEPS:
        tracker.log(metrics["step"], {k: v for k, v in metrics.items() if k != "step"},
                    samples=[("1 + 2?", "3", 1.0, "0")])
    run_dir = tracker.finish()
    with open(f"{run_dir}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert rows[0] == STEPS[0]
    assert rows[1]["mismatch/abs_diff"] is None  # NaN as null: plain JSON
    assert rows[2] == STEPS[2]
    out, err = capfd.readouterr()  # stdout and stderr are files here, as in `job > log 2>&1`
    assert "\r" not in out + err
    check_table(out.splitlines(), 3)


@pytest.mark.slow
def test_the_job_logs_a_clean_table_and_ends_with_the_plot(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    model = write_tiny_chat_model(str(tmp_path / "model"))
    capfd.readouterr()  # what writing the model printed
    args = parse_args(["--model-path", model, "--steps", "2", "--prompts", "2",
                       "--group-size", "2", "--over-sample", "0", "--max-new-tokens", "4",
                       "--filter", "none", "--wandb-dir", str(tmp_path / "runs")])
    out = run(args)
    log, err = capfd.readouterr()  # files, as in `job > log 2>&1`: no bar of any kind
    assert "\r" not in log + err
    lines = log.splitlines()
    assert lines[0].startswith("hotswap GRPO: ")
    check_table(lines[1:4], 2)
    assert lines[4].startswith("done in ")
    assert lines[-1] == f"plot written to {out['plot']}"
    assert out["plot"] == f"{out['run_dir']}/metrics.png"
    with open(out["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
