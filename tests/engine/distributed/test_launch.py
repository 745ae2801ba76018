"""Engine launchers: torchrun's environment, data-parallel seeds, refused arguments, and the
colocated torchrun example run for two steps on two ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from fixtures import TESTS_DIR, write_tiny_chat_model

from hotswap.engine.config import EngineConfig
from hotswap.engine.distributed.launch import resolve_launch

ROOT = os.path.dirname(TESTS_DIR)
EXAMPLE = os.path.join(ROOT, "examples", "torchrun_colocated.py")


def _config(**kwargs) -> EngineConfig:
    return EngineConfig(model_path="m", device="cpu", seed=7, **kwargs)


def test_spawn_keeps_the_config():
    config, launch = resolve_launch(_config())
    assert config.seed == 7 and (launch.dp_rank, launch.dp_size) == (0, 1)


def test_torchrun_reads_the_environment_and_offsets_the_seed(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    config, launch = resolve_launch(_config(launcher="torchrun"))
    assert (launch.rank, launch.dp_rank, launch.dp_size, launch.local_rank) == (3, 3, 4, 1)
    assert config.seed == 10


def test_bad_launch_arguments_are_value_errors(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="environment lacks RANK, WORLD_SIZE, LOCAL_RANK"):
        resolve_launch(_config(launcher="torchrun"))
    with pytest.raises(ValueError, match="launcher must be one of"):
        resolve_launch(_config(launcher="mpirun"))
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        resolve_launch(_config(tp_size=0))
    with pytest.raises(ValueError, match="tp_size=2 with launcher='torchrun' is not available"):
        resolve_launch(_config(tp_size=2, launcher="torchrun"))


@pytest.mark.slow
def test_torchrun_colocated_example_two_steps(tmp_path):
    model = write_tiny_chat_model(str(tmp_path / "tiny"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", EXAMPLE, "--model-path", model, "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    lines = stdout.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines[:-1]] == ["step 0", "step 1"]
    result = json.loads(lines[-1])
    ranks = result["ranks"]
    assert result["world_size"] == 2
    assert [r["version"] for r in ranks] == ["step-2", "step-2"]
    assert [r["seed"] for r in ranks] == [0, 1]  # data parallel: engine k samples with seed + k
    for r in ranks:
        assert r["trained_delta"] > 1e-6  # the optimizer moved the weights...
        assert r["weight_gap"] == 0.0  # ...and each engine holds exactly the trainer's
        assert r["probe_dlogp"] < 1e-4
