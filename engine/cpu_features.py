"""The CPU features hotswap's checks see: /proc/cpuinfo's flags, capped by HOTSWAP_CPU_ISA so
that one machine can take another CPU's code paths (docs/cpu.md). Every CPU feature check of
hotswap's (the dtype "auto" picks, the kernels built, the matmul paths) reads them here."""

from __future__ import annotations

import functools
import os

# HOTSWAP_CPU_ISA caps the CPU features hotswap sees, to take another CPU's code paths here:
# "avx2" an AVX2-only CPU, "avx512" AVX-512 without BF16, VNNI or AMX
# (docs/cpu.md#taking-another-cpus-paths-hotswap_cpu_isa).
CPU_ISA_ENV = "HOTSWAP_CPU_ISA"
CPU_ISAS = ("native", "avx512", "avx2")
_ABOVE_AVX2 = ("avx512", "amx", "avx_", "avx10")  # flag prefixes: AVX-512, AMX, AVX-VNNI, ...
_AVX512_BASE = ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")  # -march=skylake-avx512


def cpu_isa() -> str:
    """HOTSWAP_CPU_ISA: "native" (unset), "avx512" or "avx2"."""
    isa = os.environ.get(CPU_ISA_ENV, "").strip().lower() or "native"
    if isa not in CPU_ISAS:
        raise ValueError(f"{CPU_ISA_ENV}={isa!r}: expected one of {', '.join(CPU_ISAS)}")
    return isa


def read_cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where it does not exist), less those
    above HOTSWAP_CPU_ISA. Every CPU feature check of hotswap's reads them here."""
    isa = cpu_isa()
    if isa == "native":
        return set(_proc_cpu_flags())
    keep = _AVX512_BASE if isa == "avx512" else ()
    return {f for f in _proc_cpu_flags() if not f.startswith(_ABOVE_AVX2) or f in keep}


@functools.lru_cache(maxsize=1)
def _proc_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
