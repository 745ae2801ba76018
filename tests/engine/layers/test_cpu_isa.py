"""HOTSWAP_CPU_ISA: the CPU features every check of hotswap's sees
(cpu_features.read_cpu_flags), the ISA the C++ kernels are built for and the build's cache key,
and the dtype rules that follow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from hotswap.engine import cpu_features
from hotswap.engine.layers import kernel_build

CPU = frozenset({"sse4_2", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                 "avx512_vnni", "avx512vbmi", "avx_vnni", "amx_bf16", "amx_tile"})


@pytest.fixture
def cpu(monkeypatch):
    """A CPU with everything, whatever this machine has; the switch's value per test."""
    monkeypatch.setattr(cpu_features, "_proc_cpu_flags", lambda: CPU)

    def set_isa(isa: str | None) -> None:
        if isa is None:
            monkeypatch.delenv(cpu_features.CPU_ISA_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_features.CPU_ISA_ENV, isa)

    return set_isa


def test_the_switch_caps_the_flags_every_check_reads(cpu):
    cpu(None)
    assert cpu_features.read_cpu_flags() == CPU
    cpu("avx512")
    assert cpu_features.read_cpu_flags() == {"sse4_2", "avx2", "fma", "avx512f", "avx512bw",
                                       "avx512vl"}
    cpu("AVX2")
    assert cpu_features.read_cpu_flags() == {"sse4_2", "avx2", "fma"}
    cpu("avx3")
    with pytest.raises(ValueError, match="HOTSWAP_CPU_ISA='avx3'"):
        cpu_features.read_cpu_flags()


def test_auto_picks_float32_and_explicit_bf16_runs_with_its_cost_stated(cpu, caplog):
    cpu("avx2")
    dtype, why = cpu_features.auto_dtype("cpu", "bfloat16")
    assert dtype == "float32" and "avx512_bf16" in why
    with caplog.at_level("WARNING", logger=cpu_features.__name__):
        why = cpu_features.warn_emulated_bf16("cpu", "bfloat16")
    assert why is not None and "emulated" in why and why in caplog.text
    assert cpu_features.warn_emulated_bf16("cpu", "float32") is None
    assert cpu_features.warn_emulated_bf16("cuda", "bfloat16") is None
    cpu(None)
    assert cpu_features.auto_dtype("cpu", "bfloat16")[0] == "bfloat16"
    assert cpu_features.warn_emulated_bf16("cpu", "bfloat16") is None


def test_the_build_is_keyed_by_isa_and_source_bytes_not_by_checkout(cpu, tmp_path, monkeypatch):
    """Two checkouts of one version share a build; another ISA or an edited source gets its own,
    so none evicts another."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(kernel_build.SOURCE_DIR, a)
    shutil.copytree(kernel_build.SOURCE_DIR, b)

    def spec(source_dir, isa):
        monkeypatch.setattr(kernel_build, "SOURCE_DIR", source_dir)
        cpu(isa)
        return kernel_build.build_spec()

    native, avx2 = spec(a, None), spec(a, "avx2")
    assert "-march=native" in native.cflags and "-march=haswell" in avx2.cflags
    assert native.name != avx2.name and native.directory != avx2.directory
    assert spec(b, "avx2") == avx2
    (b / "rope.cpp").write_text((b / "rope.cpp").read_text() + "\n")
    assert spec(b, "avx2").name != avx2.name


def test_sources_copied_once_so_a_second_checkout_rebuilds_nothing(tmp_path, monkeypatch):
    sources = kernel_build._copy_sources(tmp_path)
    assert sources and all(s.startswith(str(tmp_path / "src")) for s in sources)
    first = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "src").iterdir()}
    assert set(first) >= {"ops.h", "vec.h", "moe.cpp"}
    kernel_build._copy_sources(tmp_path)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "src").iterdir()} == first


def test_under_the_switch_every_layer_check_answers_no():
    """A fresh process with HOTSWAP_CPU_ISA=avx2 (and torch's and oneDNN's own switches): no
    AVX-512 kernels, no VNNI copies, no blocked experts, no oneDNN bf16, the kernels built for
    AVX2."""
    code = """if True:
        import json, torch
        from hotswap.engine.layers import kernel_build, linear, moe, quant
        print(json.dumps({
            "small_rows": linear.SMALL_ROWS, "bf16_onednn": torch.bfloat16 in linear._ONEDNN_DTYPES,
            "vnni": quant.AVX512_VNNI, "expert_small_rows": moe.EXPERT_SMALL_ROWS,
            "avx512": sorted(f for f in moe.CPU_FLAGS if f.startswith(("avx512", "amx"))),
            "march": kernel_build.build_spec().cflags[1]}))
    """
    env = {**os.environ, "HOTSWAP_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
           "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out.splitlines()[-1]) == {
        "small_rows": 4, "bf16_onednn": False, "vnni": False, "expert_small_rows": 4,
        "avx512": [], "march": "-march=haswell"}
