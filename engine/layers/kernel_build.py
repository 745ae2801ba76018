"""Building the CPU kernels (cpu_kernels.py wraps them): the compile, its cache folder, keyed by
the sources' bytes, the flags, torch's version and, for -march=native, the CPU, and the removal
of builds no current source uses."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from hotswap.engine.cpu_features import cpu_isa

logger = logging.getLogger(__name__)

# Beside this file in a checkout and in an installed package alike (pyproject's package-data).
SOURCE_DIR = Path(__file__).with_name("csrc")
STALE_LOCK_S = 600
# The code each HOTSWAP_CPU_ISA compiles to: the CPU's own, or a baseline any such CPU runs.
MARCH = {"native": "-march=native", "avx512": "-march=skylake-avx512", "avx2": "-march=haswell"}
# What torch's, oneDNN's and MKL's own kernels need to take the same ISA's paths
# (docs/cpu.md#taking-another-cpus-paths-hotswap_cpu_isa).
TORCH_ISA_ENV = {
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
BUILD_NAME = re.compile(rf"hotswap_cpu_kernels_({'|'.join(MARCH)})_[0-9a-f]{{12}}")


class Build(NamedTuple):
    """Where the kernels for this ISA and these sources are built, and with what flags."""

    name: str
    directory: Path
    cflags: list[str]

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    @property
    def ready(self) -> Path:  # written once the library has loaded: later starts skip ninja
        return self.directory / "ready"


def build_spec() -> Build:
    """The build for HOTSWAP_CPU_ISA, named by a digest of everything the library depends on."""
    from torch.utils.cpp_extension import _get_build_directory

    isa = cpu_isa()
    name = build_name(isa)
    return Build(name, Path(_get_build_directory(name, verbose=False)), _cflags(isa))


def _cflags(isa: str) -> list[str]:
    # -fno-trapping-math: lets GCC if-convert (and so vectorise) the clamped exp of the SiLU, the
    # softmax and the sampler without AVX-512's masks; no value changes, only FP traps.
    return ["-O3", MARCH[isa], "-fopenmp", "-fno-trapping-math"]


def build_name(isa: str) -> str:
    """The folder name of this source's build for `isa` on this CPU."""
    digest = hashlib.sha1(" ".join([*_cflags(isa), torch.__version__]).encode())
    if isa == "native":  # -march=native: built for this CPU, never loaded on another
        digest.update(_cpu_info().encode())
    digest.update(_source_bytes())
    return f"hotswap_cpu_kernels_{isa}_{digest.hexdigest()[:12]}"


def _build_key(isa: str) -> str:
    """What a build for `isa` depends on but the CPU: written into its `ready` file, so that a
    cache shared by several machines keeps another CPU's native build of this source."""
    digest = hashlib.sha1(" ".join([*_cflags(isa), torch.__version__]).encode())
    digest.update(_source_bytes())
    return digest.hexdigest()


def _source_bytes() -> bytes:
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in _source_files())


def _cpu_info() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "".join(line for line in lines if line.startswith(("flags", "model name")))
    except OSError:
        return os.uname().machine


def _source_files() -> list[Path]:
    sources = sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h"))
    if not any(p.suffix == ".cpp" for p in sources):
        raise FileNotFoundError(f"no kernel sources in {SOURCE_DIR}")
    return sources


def build() -> bool:
    """Load the kernels for HOTSWAP_CPU_ISA, compiling them first where no finished build is
    found; False (the reason logged) where they cannot be."""
    if os.environ.get("HOTSWAP_CPU_KERNELS", "1") == "0":
        logger.info("CPU kernels off (HOTSWAP_CPU_KERNELS=0): torch ops instead")
        return False
    _check_torch_isa()
    try:
        build = build_spec()
    except OSError as e:
        logger.warning("CPU kernels not built (%s): torch ops instead, slower", e)
        return False
    if _load_built(build):
        return True
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        logger.warning("CPU kernels not built (no %s on PATH): torch ops instead, slower",
                       " or ".join(missing))
        return False
    return _compile(build)


def _load_built(build: Build) -> bool:
    """Load a finished build without asking ninja (and so without a compiler)."""
    if not build.ready.exists():
        return False
    try:
        torch.ops.load_library(str(build.library))
    except OSError as e:  # removed or damaged since: build it again
        logger.warning("CPU kernels in %s did not load (%s): rebuilding", build.directory, e)
        build.ready.unlink(missing_ok=True)
        return False
    return True


def _compile(build: Build) -> bool:
    """Compile (ninja runs cores + 2 jobs at once unless MAX_JOBS says otherwise) and load."""
    from torch.utils.cpp_extension import load

    print(f"hotswap: building CPU kernels for {cpu_isa()} (once, ~1 min) in {build.directory}",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        _drop_stale_lock(build.directory / "lock")
        load(build.name, _copy_sources(build.directory), is_python_module=False,
             build_directory=str(build.directory), extra_cflags=build.cflags,
             extra_ldflags=["-fopenmp"])
    except Exception as e:  # a compiler error, a missing header: fall back, say why
        logger.warning("CPU kernels not built (%s): torch ops instead, slower", e)
        return False
    build.ready.write_text(_build_key(cpu_isa()))
    logger.info("CPU kernels built in %.1f s", time.perf_counter() - start)
    return True


def _copy_sources(directory: Path) -> list[str]:
    """The sources copied into the build directory, which compiles them from there: ninja's
    commands then name no checkout, so a second checkout's build finds the first one's objects
    up to date. A file already there is left alone (the directory's name carries the bytes)."""
    into = directory / "src"
    into.mkdir(exist_ok=True)
    for path in _source_files():
        target = into / path.name
        if not target.exists():
            partial = target.with_suffix(f"{path.suffix}.{os.getpid()}")
            shutil.copyfile(path, partial)
            os.replace(partial, target)
    return [str(into / p.name) for p in _source_files() if p.suffix == ".cpp"]


def _check_torch_isa() -> None:
    """Under HOTSWAP_CPU_ISA, say where torch's own kernels would still use the CPU's ISA."""
    unset = {k: v for k, v in TORCH_ISA_ENV.get(cpu_isa(), {}).items() if os.environ.get(k) != v}
    if unset:
        logger.warning("HOTSWAP_CPU_ISA=%s without %s: torch's and oneDNN's own kernels still "
                       "use this CPU's ISA", cpu_isa(),
                       " ".join(f"{k}={v}" for k, v in unset.items()))


def _drop_stale_lock(lock: Path) -> None:
    """torch's build lock is a file that a build killed midway leaves behind, and every later
    load then waits on it forever; a build takes seconds, so a lock this old is such a leftover."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            logger.warning("removed a stale CPU-kernel build lock %s", lock)
    except FileNotFoundError:
        pass


def remove_old_builds(root: Path) -> list[Path]:
    """Remove the kernel builds in `root` (torch's extension folder) that no current source
    uses: each ISA's current build, another CPU's native build of this source and a folder
    changed in the last STALE_LOCK_S (a build under way) stay; nothing but hotswap's kernel
    builds is touched. Returns the folders removed."""
    keep = {build_name(isa) for isa in MARCH}
    keys = {_build_key(isa) for isa in MARCH}
    removed = []
    for path in sorted(root.iterdir()):
        if (not BUILD_NAME.fullmatch(path.name) or path.is_symlink() or not path.is_dir()
                or path.name in keep or time.time() - path.stat().st_mtime < STALE_LOCK_S):
            continue
        with contextlib.suppress(OSError):  # an older build has an empty `ready`, or none
            if (path / "ready").read_text() in keys:
                continue
        shutil.rmtree(path, ignore_errors=True)  # another setup may be removing it too
        removed.append(path)
    return removed
