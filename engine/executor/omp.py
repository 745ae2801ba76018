"""OpenMP thread teams of the process, and how the engine keeps them from slowing each other.

torch's CPU ops run on libgomp (GNU OpenMP). Each thread that runs a parallel op becomes the
master of its own team, whose worker threads live as long as that thread does. libgomp counts
every team's workers together, and once that count exceeds the CPUs it may use, every spin-wait
in the process is cut from ~300,000 iterations to 100 (`gomp_throttled_spin_count_var`): between
two parallel ops the workers sleep on a futex, and each small op pays a wake-up. That is what an
in-process trainer did to the engine: once the caller's thread had run torch ops, its idle team
(main thread + 1 worker) and the scheduler's team (+ 1 worker) made 3 managed threads on 2 CPUs,
and the engine ran at ~0.75x until the process ended.

The fix keeps one team alive at a time in the alternating pattern (trainer step, generate,
trainer step, ...): a thread that hands work to the engine releases its own team first (the
caller blocks in generate anyway), and the scheduler thread releases its team when it goes idle,
so the trainer's next step runs unthrottled too. A released team is rebuilt by the thread's next
parallel op (one thread start, ~0.1 ms). `omp_pause_resource_all` in libgomp frees only the
calling thread's team and refuses inside a parallel region; other OpenMP runtimes (LLVM libomp)
pause process-wide, so there this is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any

# omp_pause_resource_t: omp_pause_soft = 1 (threads end; the runtime stays initialised).
_OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process already has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return lib
    return None


def release_thread_team() -> bool:
    """End the calling thread's OpenMP worker threads; False where the runtime is not libgomp.

    Safe from any thread at any time outside a parallel region: other threads' teams are not
    touched, and this thread's next parallel op starts a new team."""
    lib = _libgomp()
    if lib is None:
        return False
    return lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0


def in_own_thread(fn: Callable[[], Any]) -> Any:
    """Run fn in a short-lived thread: its OpenMP workers exit with it.

    Every thread that runs parallel torch ops keeps its own OpenMP team. With more workers alive
    than cores libgomp stops spinning between parallel regions, and each small op in the
    scheduler thread pays a futex wake-up (measured: a [64, 576] mul took 47 us instead of
    4 us; a SmolLM2 decode step at batch 64, 193 ms instead of 160 ms). Loading the model here,
    not in the caller's thread, keeps the scheduler's team the only one.
    """
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=run, name="hotswap-load")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
