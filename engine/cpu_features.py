"""The CPU features hotswap's checks see: /proc/cpuinfo's flags, capped by HOTSWAP_CPU_ISA so
that one machine can take another CPU's code paths (docs/cpu.md). Every CPU feature check of
hotswap's (the dtype "auto" picks, the kernels built, the matmul paths) reads them here."""

from __future__ import annotations

import functools
import logging
import os

# CPU flags under which bf16 matmuls run natively (oneDNN); without them bf16 is emulated, slow.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# What bf16 costs without them, in cpu_kernels.blocked_linear (bench/throughput.py under
# HOTSWAP_CPU_ISA=avx2 on the EPYC: batch 64 0.88-0.92x of float32's tok/s, batch 1 1.35-1.45x).
BF16_EMULATED_COST = "a batch of 64 decodes at ~0.9x float32's speed, batch 1 at ~1.4x"

logger = logging.getLogger(__name__)

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


def auto_dtype(device: str, checkpoint_dtype: str, cpu_flags: set[str] | None = None
               ) -> tuple[str, str]:
    """dtype="auto": the checkpoint's dtype where the device runs it fast, else float32.

    Returns (dtype, the reason, for the log). On CPU only bf16 with AVX512-BF16 or AMX counts as
    fast; float16 never does (no native fp16 matmul path on CPU here)."""
    wanted = checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "float32"
    if wanted == "float32":
        return "float32", f"the checkpoint's dtype is {checkpoint_dtype}"
    if device == "cuda":
        return wanted, "the checkpoint's dtype, on CUDA"
    flags = cpu_flags if cpu_flags is not None else read_cpu_flags()
    have = [f for f in CPU_BF16_FLAGS if f in flags]
    if wanted == "bfloat16" and have:
        return "bfloat16", f"the checkpoint's dtype; this CPU has {', '.join(have)}"
    return "float32", (f"the checkpoint is {wanted} but this CPU has none of "
                       f"{', '.join(CPU_BF16_FLAGS)}" if wanted == "bfloat16" else
                       "the checkpoint is float16, which has no fast CPU path")


def warn_emulated_bf16(device: str, dtype: str, cpu_flags: set[str] | None = None) -> str | None:
    """An explicit dtype="bfloat16" on a CPU without native bf16 runs (bf16 widened to float32
    inside every matmul), at a cost the log states; returns that warning, or None."""
    flags = cpu_flags if cpu_flags is not None else read_cpu_flags()
    if device != "cpu" or dtype != "bfloat16" or any(f in flags for f in CPU_BF16_FLAGS):
        return None
    why = (f"dtype='bfloat16' on a CPU without {' or '.join(CPU_BF16_FLAGS)}: bf16 products are "
           f"emulated in float32, {BF16_EMULATED_COST}; dtype='float32' (or 'auto') is exact "
           "at about the speed of a large batch here")
    logger.warning(why)
    return why
