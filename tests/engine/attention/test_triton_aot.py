"""Every Triton attention kernel compiled ahead of time for sm_80, sm_89 and sm_90 (no GPU needed)
with the launch configuration the backend picks there, and checked against the architecture's
shared memory and register file. HOTSWAP_AOT_ALL=1 compiles every dtype x head size x kernel;
the default run compiles the configurations nearest the limits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hotswap.engine.attention.triton_launch import SHARED_MEMORY_PER_BLOCK

pytest.importorskip("triton.backends.nvidia")

SCRIPT = Path(__file__).with_name("triton_aot.py")
REGISTERS_PER_BLOCK = 65536  # sm_80 through sm_90
MAX_REGISTERS_PER_THREAD = 255
ARCHS = (80, 89, 90)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float32", "bfloat16", "float16")
KERNELS = ("decode_split", "decode_reduce", "extend")


def job(kernel: str, arch: int, dtype: str, head_dim: int, group: int = 3) -> dict:
    return {"kernel": kernel, "arch": arch, "dtype": dtype, "head_dim": head_dim, "group": group}


# float32 on the ~99 KB of sm_89 (and sm_86) is where the first tiles did not fit.
DEFAULT_JOBS = [
    job("extend", 89, "float32", 128),
    job("extend", 89, "float32", 256),
    job("decode_split", 89, "float32", 256),
    job("extend", 80, "float32", 256),
    job("extend", 90, "bfloat16", 128, group=8),
]
ALL_JOBS = [job(k, a, d, h) for a in ARCHS for d in DTYPES for h in HEAD_DIMS for k in KERNELS]


def compile_jobs(jobs: list[dict]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(SCRIPT), json.dumps(jobs)], capture_output=True,
                          text=True, env=env, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_compiled_kernels_fit_each_architecture():
    jobs = ALL_JOBS if os.environ.get("HOTSWAP_AOT_ALL") == "1" else DEFAULT_JOBS
    results = compile_jobs(jobs)
    assert len(results) == len(jobs)
    assert {r["arch"] for r in results} == set(ARCHS)
    too_big = []
    for r in results:
        where = f"{r['kernel']} sm_{r['arch']} {r['dtype']} d{r['head_dim']} tiles {r['config']}"
        if r["shared"] > SHARED_MEMORY_PER_BLOCK[r["arch"]]:
            too_big.append(f"{where}: {r['shared']} B shared > "
                           f"{SHARED_MEMORY_PER_BLOCK[r['arch']]}")
        if r["regs"] > MAX_REGISTERS_PER_THREAD or r["regs"] * r["threads"] > REGISTERS_PER_BLOCK:
            too_big.append(f"{where}: {r['regs']} registers x {r['threads']} threads")
    assert not too_big, "\n".join(too_big)
