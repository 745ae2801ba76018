"""bench/gpu_check.py's CPU side: arguments, stage order, JSON report, stop at first failure."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def test_stages_run_in_order_within_the_budget(gpu_check):
    args = gpu_check.parse_args([])
    stages = gpu_check.plan(args, gpus=2)
    assert [s.name for s in stages] == [
        "tests", "attention-tests", "throughput-torch", "throughput-triton",
        "throughput-flashinfer", "throughput-hf", "weight-sync"]
    assert sum(s.timeout_s for s in stages) <= gpu_check.BUDGET_S
    assert stages[0].argv[1:] == ["-m", "pytest", "-q", "-x", "-m", "gpu"]
    assert all(s.argv[0] == sys.executable and not s.skip for s in stages)


def test_one_gpu_skips_the_nccl_stage_saying_why(gpu_check):
    stages = gpu_check.plan(gpu_check.parse_args(["--stages", "weight-sync"]), gpus=1)
    assert [(s.name, bool(s.skip)) for s in stages] == [("weight-sync", True)]
    assert "2 GPUs" in stages[0].skip


def test_bad_arguments_are_refused(gpu_check, capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--backends", "torch,xformers"])
    assert "xformers" in capsys.readouterr().err
    args = gpu_check.parse_args(["--backends", "triton", "--stages", "throughput"])
    assert [s.name for s in gpu_check.plan(args, 1)] == ["throughput-triton", "throughput-hf"]


def fake_runner(outcomes: dict[str, tuple[int, dict]], ran: list[str]):
    def run(stage, result_path):
        ran.append(stage.name)
        rc, result = outcomes.get(stage.name, (0, {}))
        Path(result_path).write_text(json.dumps(result))
        return rc, [f"{stage.name} output"]
    return run


def test_report_holds_every_stage_and_the_ratios(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CUDA mocked away
    stages = gpu_check.plan(gpu_check.parse_args(["--backends", "torch,triton"]), gpus=1)
    ran: list[str] = []
    out = tmp_path / "gpu.json"
    tok = {"batch64": 900.0, "grpo8x8": 800.0, "batch1": 60.0}
    report = gpu_check.run_stages(stages, str(out), fake_runner({
        "throughput-torch": (0, tok), "throughput-triton": (0, {**tok, "batch64": 1800.0}),
        "throughput-hf": (0, {"batch64": 450.0, "grpo8x8": 400.0, "batch1": 30.0})}, ran))
    assert ran == ["tests", "attention-tests", "throughput-torch", "throughput-triton",
                   "throughput-hf"]
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(report))
    assert [s["status"] for s in written["stages"]] == ["ok"] * 5 + ["skipped"]
    assert written["failed"] is None
    assert written["ratios"]["throughput-triton"] == {"batch64": 4.0, "grpo8x8": 2.0,
                                                      "batch1": 2.0}


def test_first_failure_stops_the_run_and_names_the_command(gpu_check, tmp_path, capsys):
    stages = gpu_check.plan(gpu_check.parse_args([]), gpus=2)
    ran: list[str] = []
    out = tmp_path / "gpu.json"
    report = gpu_check.run_stages(stages, str(out), fake_runner(
        {"throughput-triton": (1, {})}, ran))
    assert ran == ["tests", "attention-tests", "throughput-torch", "throughput-triton"]
    failed = json.loads(out.read_text())["failed"]
    assert failed == report["failed"] and failed["stage"] == "throughput-triton"
    assert "--backend triton" in failed["command"]
    assert "rerun with" in capsys.readouterr().out


def test_without_cuda_it_says_so_and_exits_nonzero(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", "unused.json"]) == 2
    assert "needs CUDA" in capsys.readouterr().err
    assert gpu_check.main(["--dry-run"]) == 0
    assert "throughput-flashinfer" in capsys.readouterr().out
