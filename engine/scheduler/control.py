"""The scheduler's control methods: the only writers of scheduling state from outside the loop.

Pause and resume, admission holds, finishing or retracting the requests a predicate picks, cache
flush and reset, namespace retirement, KV memory release and the integrity check. Any thread may
call them; each runs on the scheduler thread between steps through `Scheduler.run`, the one way
of handing work to that thread. The Engine, the WeightManager and the LoRAManager act on
scheduling state only through these; readers (metrics, load reports) use `load()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from hotswap.engine.core.namespace import Namespace
from hotswap.engine.core.request import FinishReason, Req

if TYPE_CHECKING:
    from hotswap.engine.executor.model_runner import ModelRunner
    from hotswap.engine.kvcache.radix_cache import RadixCache
    from hotswap.engine.multimodal.encoder_cache import EncoderCache
    from hotswap.engine.scheduler.kv_manager import KVManager
    from hotswap.engine.speculative.speculator import Speculator


@dataclass(frozen=True)
class SchedulerLoad:
    """How busy the scheduler is: request counts, KV use and running totals, as of one moment."""

    running: int  # admitted, holding KV
    waiting: int  # queued for admission
    forked: int  # n > 1 samples waiting for their leader's prompt KV
    compiling: int  # waiting for their grammar to compile
    kv_used_tokens: int  # KV pool slots not free: running requests and the prefix cache
    kv_cached_tokens: int  # KV slots held by the prefix cache
    kv_pool_tokens: int  # KV pool size in tokens
    sessions: int  # open sessions
    # Since start: prompt_tokens, generated_tokens, cached_tokens (prompt tokens found in the
    # prefix cache), prefill_tokens, steps, step_s.
    totals: dict[str, float] = field(default_factory=dict)
    # Speculator.describe(): draft lengths chosen, a learned draft's version and acceptance
    speculative: dict[str, Any] | None = None

    @property
    def unfinished(self) -> int:
        return self.running + self.waiting + self.forked + self.compiling

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_pool_tokens if self.kv_pool_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SchedulerControl:
    """Mixed into Scheduler, which provides the state below and `run`, `finish`, `retract`,
    `abort_running`, `abort_waiting` and `retract_all`."""

    paused: bool
    admission_held: bool
    running: list[Req]
    waiting: list[Req]
    forks: dict[str, list[Req]]
    grammar_queue: list[Req]
    tree: RadixCache
    kv: KVManager
    runner: ModelRunner
    stats: dict[str, float]
    encoder: EncoderCache | None
    spec: Speculator | None

    def load(self) -> SchedulerLoad:
        """Any thread, without waiting for a step: each count is one read of a length or a
        counter (atomic under the GIL), never a walk over what the scheduler thread mutates."""
        allocator = self.runner.allocator
        forks = list(self.forks.values())
        return SchedulerLoad(
            running=len(self.running), waiting=len(self.waiting), forked=sum(map(len, forks)),
            compiling=len(self.grammar_queue),
            kv_used_tokens=allocator.size - allocator.available_size(),
            kv_cached_tokens=self.tree.total_size(), kv_pool_tokens=allocator.size,
            sessions=len(self.sessions), totals=dict(self.stats),
            speculative=None if self.spec is None else self.spec.describe())

    def finish_where(self, picked: Callable[[Req], bool], reason: FinishReason,
                     queued: bool = True) -> int:
        """End the running requests `picked` selects (their KV freed) and, with `queued`, the
        ones still waiting (for admission, a fork leader or a grammar); returns how many."""
        return self.run(lambda: self._finish_where_now(picked, reason, queued))

    def retract_where(self, picked: Callable[[Req], bool]) -> int:
        """Retract the running requests `picked` selects, newest first: their KV is dropped
        and they queue to be recomputed from prompt + output so far; returns how many."""
        def on_thread() -> int:
            hits = sorted((r for r in self.running if picked(r)), key=lambda r: -r.admit_seq)
            for req in hits:
                self.retract(req)
            return len(hits)

        return self.run(on_thread)

    def _finish_where_now(self, picked: Callable[[Req], bool], reason: FinishReason,
                          queued: bool) -> int:
        hits = self._take_queued(picked) if queued else []
        hits += [r for r in self.running if picked(r)]
        for req in hits:
            self.finish(req, reason)
        return len(hits)

    def _take_queued(self, picked: Callable[[Req], bool]) -> list[Req]:
        """Remove the picked requests from every queue (forks first: finishing a leader moves
        its forks to the waiting queue) and return them."""
        taken = []
        for leader, forks in list(self.forks.items()):
            taken += [r for r in forks if picked(r)]
            kept = [r for r in forks if not picked(r)]
            if kept:
                self.forks[leader] = kept
            else:
                del self.forks[leader]
        taken += [r for r in self.waiting if picked(r)]
        self.waiting[:] = [r for r in self.waiting if not picked(r)]
        taken += [r for r in self.grammar_queue if picked(r)]
        self.grammar_queue[:] = [r for r in self.grammar_queue if not picked(r)]
        return taken

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
        """What a pause or a weight update does to running requests (docs/api.md#pause-modes)."""
        if mode == "abort":
            self.run(lambda: self.abort_running(FinishReason.aborted(
                "paused", f"aborted: generation paused (mode {mode})")))
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
        """Make cached prefixes of the matching namespaces unreachable (invariant 1); running
        requests under one (an in_place update) keep their KV, which never reaches the tree.
        Sessions' pins there are dropped, which frees that KV."""
        def on_thread() -> None:
            self.tree.retire_where(retired)
            if self.encoder is not None:
                self.encoder.retire_where(retired)
            self.sessions.unpin_retired(retired)
            for ns in {r.namespace for r in self.running if r.namespace is not None}:
                if retired(ns):
                    self.tree.retire_namespace(ns)

        self.run(on_thread)

    def abort_all(self, reason: FinishReason) -> None:
        def on_thread() -> None:
            self.abort_running(reason)
            self.abort_waiting(reason)

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
                if self.spec is not None:
                    self.spec.memory(release=True)
            return {"success": True, "message": f"released {', '.join(tags)}"}

        return self.run(on_thread)

    def resume_memory(self, tags: list[str]) -> dict:
        def on_thread() -> dict:
            if "kv_cache" in tags and not self.runner.kv_pool.allocated:
                self.runner.kv_pool.allocate()
                if self.spec is not None:
                    self.spec.memory(release=False)
            return {"success": True, "message": f"resumed {', '.join(tags)}"}

        return self.run(on_thread)

    def check_integrity(self) -> None:
        """Invariant 2 (conservation) and the tree's own checks."""
        self.run(lambda: self.kv.check_integrity(self.running))

    def open_session(self, ttl_s: float, session_id: str | None) -> str:
        return self.run(lambda: self.sessions.open(ttl_s, session_id))

    def close_session(self, session_id: str) -> bool:
        return self.run(lambda: self.sessions.close(session_id))

    def _reset_kv(self) -> None:
        self.sessions.forget_pins()
        self.tree.reset()
        if self.encoder is not None:
            self.encoder.clear()
        self.runner.allocator.clear()
