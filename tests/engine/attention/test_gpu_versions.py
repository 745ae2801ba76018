"""The GPU modules import with the installed triton, or fail naming the versions they need."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch
import triton

from hotswap.engine.attention import triton_kernels

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def test_installed_versions_meet_the_declared_floors():
    text = PYPROJECT.read_text()
    torch_floor = re.search(r'"torch>=([\d.]+)', text).group(1)
    assert version(torch.__version__) >= version(torch_floor)
    assert version(triton.__version__) >= version(triton_kernels.MIN_TRITON)
    assert f'"triton>={triton_kernels.MIN_TRITON}"' in text
    assert re.search(r'"flashinfer-python>=[\d.]+,<[\d.]+"', text), "pin flashinfer to a range"


def test_a_triton_without_knobs_fails_with_the_versions_named():
    code = ("import sys, triton; del triton.knobs; sys.modules['triton.knobs'] = None\n"
            "import hotswap.engine.attention.triton_kernels")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "need triton>=3.4 (torch>=2.8); found triton" in proc.stderr
