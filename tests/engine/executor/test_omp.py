"""OpenMP team release (executor/omp.py): the caller's and the idle scheduler's teams end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from hotswap.engine import Engine
from hotswap.engine.executor import omp

needs_team = pytest.mark.skipif(
    omp._libgomp() is None or torch.get_num_threads() < 2,
    reason="needs torch on libgomp with at least 2 threads")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_op() -> None:
    a = torch.randn(256, 256)
    for _ in range(3):
        a = a @ a.T / 256


_RELEASE_CHECK = """
import json, os, threading, time, torch
from hotswap.engine.executor import omp

def threads():
    return len(os.listdir("/proc/self/task"))

def parallel_op():
    a = torch.randn(256, 256)
    for _ in range(3):
        a = a @ a.T / 256

seen = {}
def worker():
    before = threads()
    parallel_op()  # this thread now masters a team: its worker threads exist
    seen["with_team"] = threads() - before
    assert omp.release_thread_team()
    deadline = time.monotonic() + 2  # an ended worker can linger in /proc for a moment
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    seen["released"] = threads() - before
    parallel_op()  # and the next parallel op simply starts a new team
    seen["again"] = threads() - before
    omp.release_thread_team()

t = threading.Thread(target=worker)
t.start()
t.join()
print(json.dumps({**seen, "workers": torch.get_num_threads() - 1}))
"""


@needs_team
def test_release_ends_the_calling_threads_workers():
    # A fresh process: OpenMP teams that earlier tests' threads left behind would be counted.
    out = subprocess.run([sys.executable, "-c", _RELEASE_CHECK], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    workers = seen.pop("workers")
    assert workers >= 1
    assert seen == {"with_team": workers, "released": 0, "again": workers}


@needs_team
def test_engine_releases_the_callers_team_and_its_own_when_idle(tiny_chat_model_path):
    """The alternating pattern: the caller's thread runs torch ops (a trainer step), then
    generates; while the engine works the caller keeps no team, and once it is idle neither
    does the engine, so the next trainer step is the only team in the process."""
    released_by: list[str] = []
    real = omp.release_thread_team

    def spy() -> bool:
        released_by.append(threading.current_thread().name)
        return real()

    import hotswap.engine.scheduler.scheduler as sched_mod

    with Engine(tiny_chat_model_path, dtype="float32", max_total_tokens=2048) as engine:
        sched_mod.release_thread_team = spy
        try:
            omp.release_thread_team()  # earlier tests may have left this thread a team
            baseline = _threads()
            _parallel_op()
            assert _threads() > baseline  # the caller's team
            engine.generate(input_ids=[[5, 6, 7]] * 4, sampling_params={
                "max_new_tokens": 8, "ignore_eos": True, "temperature": 0})
            engine.scheduler.run(lambda: None)  # the loop went idle again
            assert _threads() <= baseline
        finally:
            sched_mod.release_thread_team = real
    assert threading.current_thread().name in released_by
    assert "hotswap-scheduler" in released_by
