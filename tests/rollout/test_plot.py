"""`python -m hotswap.rollout.plot RUN_DIR`: the picture of a run, redrawn from its logged rows."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from hotswap.rollout.plot import DPI, FIGSIZE, figure, main


def logged_run(run_dir, steps: int = 6) -> list[dict]:
    """A run folder as the Tracker leaves it: one JSON row per step in metrics.jsonl."""
    rows = [{"step": s, "weight_version": s, "reward/sampled_mean": 0.2 + 0.1 * s,
             "reward/mean": 0.3 + 0.1 * s, "mismatch/abs_diff": 9e-6 - 1e-6 * s,
             "mismatch/kl": 2e-9, "rollout/tokens_per_s": 300.0 + s,
             "time/weight_sync_s": 0.06, "time/train_s": 5.0} for s in range(steps)]
    rows[2]["mismatch/kl"] = None  # logged as NaN
    del rows[3]["reward/sampled_mean"]
    run_dir.mkdir(exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_the_module_redraws_the_png_of_a_run(tmp_path, capsys):
    logged_run(tmp_path / "offline-run-1")
    main([str(tmp_path / "offline-run-1")])
    path = capsys.readouterr().out.strip()
    assert path == str(tmp_path / "offline-run-1" / "metrics.png")
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (FIGSIZE[0] * DPI, FIGSIZE[1] * DPI)
        darkest, lightest = image.convert("L").getextrema()
        assert darkest < 100 and lightest == 255  # lines and text drawn on white
    main([str(tmp_path / "offline-run-1"), "--out", str(tmp_path / "elsewhere.png")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "elsewhere.png")
    assert Image.open(tmp_path / "elsewhere.png").size == (FIGSIZE[0] * DPI, FIGSIZE[1] * DPI)


def test_one_panel_per_quantity_with_the_step_on_the_x_axis(tmp_path):
    rows = logged_run(tmp_path)
    axes = figure(rows).axes
    assert [ax.get_title() for ax in axes] == ["reward", "trainer vs engine logprobs",
                                               "generation speed", "weight update"]
    assert [ax.get_ylabel() for ax in axes] == ["mean reward per sample", "per sampled token",
                                                "generated tokens / s", "seconds"]
    assert [ax.get_xlabel() for ax in axes[2:]] == ["step", "step"]
    reward, mismatch, speed, update = axes
    sampled, kept = reward.get_lines()
    assert list(sampled.get_xdata()) == [0, 1, 2, 4, 5]  # step 3 did not log it
    assert list(kept.get_ydata()) == pytest.approx([r["reward/mean"] for r in rows])
    assert [line.get_label() for line in mismatch.get_lines()] == [
        "|dlogp| (mean abs. difference)", "kl (k3 estimate)"]
    assert list(mismatch.get_lines()[1].get_xdata()) == [0, 1, 3, 4, 5]  # NaN left out
    assert mismatch.get_yscale() == "log"
    assert list(speed.get_lines()[0].get_ydata()) == [300.0 + s for s in range(6)]
    assert speed.get_ylim()[0] == 0 and update.get_ylim()[0] == 0
    assert list(update.get_lines()[0].get_ydata()) == [0.06] * 6


def test_a_quantity_the_run_did_not_log_is_said_so(tmp_path):
    rows = [{"step": 0, "reward/mean": 0.5, "mismatch/abs_diff": 0.0, "mismatch/kl": 0.0}]
    reward, mismatch, speed, update = figure(rows).axes
    assert len(reward.get_lines()) == 1
    assert mismatch.get_yscale() == "linear"  # exact logprobs: zeros have no log
    assert [t.get_text() for t in speed.texts] == ["not logged in this run"]
    assert not update.get_lines()


def test_a_folder_without_rows_is_refused_with_what_to_give(tmp_path):
    with pytest.raises(SystemExit, match="metrics.jsonl: no logged rows; RUN_DIR is the run"):
        main([str(tmp_path)])
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match="no rows"):
        main([str(tmp_path)])
