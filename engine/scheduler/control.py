"""The scheduler's control methods: the only writers of scheduling state from outside the loop.

Pause and resume, admission holds, cache flush and reset, namespace retirement, KV memory release
and the integrity check. Any thread may call them; each runs on the scheduler thread between
steps through `Scheduler.run`, the one way of handing work to that thread. The Engine and the
WeightManager act on scheduling state only through these.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hotswap.engine.core.namespace import Namespace

if TYPE_CHECKING:
    from hotswap.engine.executor.model_runner import ModelRunner
    from hotswap.engine.kvcache.radix_cache import RadixCache
    from hotswap.engine.scheduler.kv_manager import KVManager


class SchedulerControl:
    """Mixed into Scheduler, which provides the state below and `run`, `abort_running`,
    `abort_waiting` and `retract_all`."""

    paused: bool
    admission_held: bool
    running: list
    waiting: list
    forks: dict[str, list]
    tree: RadixCache
    kv: KVManager
    runner: ModelRunner

    def pause(self, mode: str) -> dict:
        def on_thread() -> dict:
            self.apply_pause_mode(mode)
            self.paused = True
            return {"success": True, "message": f"paused ({mode})"}

        return self.run(on_thread)

    def resume(self) -> dict:
        def on_thread() -> dict:
            self.paused = False
            return {"success": True, "message": "resumed"}

        return self.run(on_thread)

    def apply_pause_mode(self, mode: str) -> None:
        """What a pause or a weight update does to running requests (API.md, pause modes)."""
        if mode == "abort":
            self.run(lambda: self.abort_running(f"aborted: generation paused (mode {mode})"))
        elif mode == "retract":
            self.run(self.retract_all)

    def hold_admission(self, held: bool) -> None:
        """While held, no waiting request is admitted (running ones go on)."""
        def on_thread() -> None:
            self.admission_held = held

        self.run(on_thread)

    def flush_cache(self, timeout_s: float | None) -> dict:
        """Drop every cached prefix once no request holds KV; waits up to timeout_s for that
        (the caller's thread waits, not this one)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.hold_admission(True)
        try:
            while True:
                state = self.reset_cache()
                if state is None:
                    return {"success": True, "message": "cache flushed"}
                if self.paused or (deadline is not None and time.monotonic() > deadline):
                    return {"success": False, "message": state}
                time.sleep(0.01)
        finally:
            self.hold_admission(False)

    def reset_cache(self) -> str | None:
        """Empty the prefix tree and the allocator; None, or why not (requests hold KV)."""
        def on_thread() -> str | None:
            if self.running:
                return f"{len(self.running)} running request(s) still hold KV"
            self._reset_kv()
            self.kv.check_integrity([])
            return None

        return self.run(on_thread)

    def retire_namespaces(self, retired: Callable[[Namespace], bool]) -> None:
        """Make cached prefixes of the matching namespaces unreachable (invariant 1)."""
        self.run(lambda: self.tree.retire_where(retired))

    def abort_all(self, message: str) -> None:
        def on_thread() -> None:
            self.abort_running(message)
            self.abort_waiting(message)

        self.run(on_thread)

    def release_memory(self, tags: list[str]) -> dict:
        """Free the KV pool ("kv_cache" in tags); refused while any request is queued or
        running, whatever the tags (weights are released only then too)."""
        def on_thread() -> dict:
            busy = len(self.running) + len(self.waiting) + sum(map(len, self.forks.values()))
            if busy:
                return {"success": False, "message": f"{busy} request(s) queued or running; "
                        "wait for them or abort them before releasing memory"}
            if "kv_cache" in tags and self.runner.kv_pool.allocated:
                self._reset_kv()
                self.runner.kv_pool.release()
            return {"success": True, "message": f"released {', '.join(tags)}"}

        return self.run(on_thread)

    def resume_memory(self, tags: list[str]) -> dict:
        def on_thread() -> dict:
            if "kv_cache" in tags and not self.runner.kv_pool.allocated:
                self.runner.kv_pool.allocate()
            return {"success": True, "message": f"resumed {', '.join(tags)}"}

        return self.run(on_thread)

    def check_integrity(self) -> None:
        """Invariant 2 (conservation) and the tree's own checks."""
        self.run(lambda: self.kv.check_integrity(self.running))

    def _reset_kv(self) -> None:
        self.tree.reset()
        self.runner.allocator.clear()
