"""The weight-update transaction: every update, whatever its route, is one.

Lifecycle (docs/api.md#the-weight-update-transaction):
1. open: the update's names, dtypes and shapes are checked against the model, its pause mode and
   version too (weight_manager.py, before any piece exists). One transaction is open at a time:
   a piece of an update that holds generation joins it; anything else is refused.
2. receive: pieces arrive (tensors, a checkpoint, a broadcast, buckets), each one checked for
   NaN and inf. Where they land is the transaction's storage:
   - "in_place": into the live weights, generation held from the first piece to the commit
     (a one-call update, and SGLang's commit=False pieces);
   - "standby": beside the live weights (the standby buffer, the tensors in hand, or the
     tensor-parallel ranks' shards) while serving goes on, installed at the commit
     (the prepare_weights_* calls).
3. commit: under the pause mode, install what waits, bump the version once, retire every older
   cache namespace, and resume.
4. abort: nothing changes unless pieces were already written in place; then the weights are
   half a version and generation is refused until a complete update rewrites them.
A transaction left untouched for weight_update_timeout_s is aborted.

Everything here runs on the scheduler thread, between steps, except the expiry timer, which
hands its work to that thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hotswap.engine.core.namespace import ServingVersion
from hotswap.engine.core.request import FinishReason
from hotswap.engine.errors import WeightsIncompleteError
from hotswap.engine.weights.receive import Stages
from hotswap.weight_sync.versions import next_version

if TYPE_CHECKING:
    from hotswap.engine.executor.model_runner import ModelRunner
    from hotswap.engine.scheduler.scheduler import Scheduler

STORAGES = ("in_place", "standby")


def _nothing() -> None:
    pass


@dataclass
class Piece:
    """One received part of an update. `install` makes it live (scheduler thread, generation
    paused); `discard` runs instead when it never will be (refused, aborted); `release` runs at
    the end either way (frees what held it)."""

    names: list[str]  # the storage names it writes (aliases resolved by the caller)
    install: Callable[[], None]
    source: str
    discard: Callable[[], None] = _nothing
    release: Callable[[], None] = _nothing
    base_version: str | None = None  # a delta: the only version it may be applied to


@dataclass
class WeightUpdate:
    """The open transaction."""

    storage: str  # one of STORAGES
    pause_mode: str
    was_paused: bool  # the user's own pause: restored, not lifted, at the end
    weight_version: str | None = None  # asked for by any piece (the last one wins)
    written: set[str] = field(default_factory=set)  # names written into the live weights
    waiting: list[Piece] = field(default_factory=list)  # standby pieces, installed at commit
    sources: list[str] = field(default_factory=list)
    touched: float = field(default_factory=time.monotonic)

    @property
    def holds_generation(self) -> bool:
        return self.storage == "in_place"

    def describe(self) -> str:
        names = self.written.union(*(p.names for p in self.waiting))
        where = "written in place" if self.holds_generation else "received beside the weights"
        return f"{len(self.sources)} piece(s), {len(names)} tensor(s) {where}"


class Transactions:
    """The one open weight update, the serving version it commits, and the damage a failed one
    leaves (names half-written: generation is refused until they are rewritten)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, serving: ServingVersion):
        self.runner = runner
        self.scheduler = scheduler
        self.serving = serving
        self.open: WeightUpdate | None = None
        self.incomplete: str | None = None  # why the weights are partly overwritten
        self.damaged: set[str] = set()
        self.last_update_s: float | None = None
        self._timeout_s = runner.config.weight_update_timeout_s
        self._timer: threading.Timer | None = None

    def check_servable(self) -> None:
        if self.incomplete is not None:
            raise WeightsIncompleteError(
                f"weights are incomplete ({self.incomplete}); generation is refused until an "
                "update rewrites every affected tensor")

    def check_none_open(self, what: str) -> None:
        if self.open is not None:
            raise ValueError(f"a weight update is open ({self.open.describe()}); commit or "
                             f"abort it before {what}")

    def pause_generation(self, mode: str) -> dict:
        """The user's pause: it outlives an open update, which restores it instead of lifting
        it at its end (was_paused, written here on the scheduler thread)."""
        out = self.scheduler.pause(mode)
        if self.open is not None:
            self.open.was_paused = True
        return out

    # receive

    def add(self, piece: Piece, storage: str, requested: str | None, pause_mode: str,
            commit: bool, stages: Stages) -> dict:
        """A piece joins the open transaction (in place only) or opens one; commit=True then
        commits. A refused piece is discarded and raises ValueError."""
        stages.lap("queue")
        txn = self.open
        if txn is not None and (storage == "standby" or not txn.holds_generation):
            self._refuse(piece, f"a weight update is open ({txn.describe()}); commit or abort "
                         "it first")
        if piece.base_version is not None and (txn is not None or self.incomplete is not None
                                               or piece.base_version != self.serving.label):
            self._refuse(piece, f"{piece.source} is a delta against version "
                         f"{piece.base_version!r}; this engine serves {self.serving.label!r}"
                         + ("" if txn is None and self.incomplete is None
                            else " and its weights are not that version's"))
        if txn is None:
            txn = self._open(storage, pause_mode)
            if txn.holds_generation:
                stages.lap("pause")
        txn.sources.append(piece.source)
        txn.touched = time.monotonic()
        if requested is not None:
            txn.weight_version = requested
        if not txn.holds_generation:
            txn.waiting.append(piece)
            return {"success": True, "message": f"prepared {piece.source}",
                    "weight_version": self.proposed_version()}
        try:
            txn.written |= set(piece.names)
            piece.install()
        except Exception as exc:  # noqa: BLE001 - reported, and the engine refuses to serve
            what = f"writing {piece.source}"
            if commit:
                version = txn.weight_version or self.proposed_version()
                what = f"update to version {version!r} failed while {what}"
            return self._fail(txn, f"{what} failed: {exc}" if not commit else f"{what}: {exc}")
        finally:
            piece.release()
        stages.lap("install")
        self.runner.weights_changed()
        if commit:
            return self.commit(None, None, stages)
        return {"success": True, "weight_version": self.serving.label,
                "message": f"staged ({txn.describe()}); serving version "
                           f"{self.serving.label!r} until the commit"}

    @staticmethod
    def _refuse(piece: Piece, why: str) -> None:
        piece.discard()
        piece.release()
        raise ValueError(why)

    def _open(self, storage: str, pause_mode: str) -> WeightUpdate:
        txn = WeightUpdate(storage, pause_mode, was_paused=self.scheduler.paused)
        if txn.holds_generation:
            self.scheduler.pause(pause_mode)
        self.open = txn
        self._arm(txn)
        return txn

    # commit / abort

    def commit(self, requested: str | None, pause_mode: str | None,
               stages: Stages | None = None) -> dict:
        """One version for everything the open transaction received; ValueError when none is
        open, or for a pause mode other than the one an in-place update paused with."""
        stages = stages or Stages()
        txn = self.open
        if txn is None:
            raise ValueError("no weight update is open: nothing to commit")
        if txn.holds_generation and pause_mode not in (None, txn.pause_mode):
            raise ValueError(f"pause_mode {pause_mode!r}: this update paused generation with "
                             f"{txn.pause_mode!r} when it opened")
        start = time.perf_counter()
        version = self._next_version(requested or txn.weight_version)
        if not txn.holds_generation:
            self.scheduler.apply_pause_mode(pause_mode or txn.pause_mode)
            stages.lap("pause")
        try:
            while txn.waiting:
                piece = txn.waiting.pop(0)
                txn.written |= set(piece.names)
                try:
                    piece.install()
                finally:
                    piece.release()
            stages.lap("install")
            self.runner.weights_changed()
            if self.runner.config.quantization is not None:
                # int8 copies before the version bumps (a failure fails the update); other
                # engines rebuild their packed copies at the next forward.
                self.runner.refresh_derived(stages.lap)
        except Exception as exc:  # noqa: BLE001 - reported, and the engine refuses to serve
            return self._fail(txn, f"update to version {version!r} failed while writing: {exc}")
        self.serve(version, txn.written)
        self._close(txn)
        self.last_update_s = time.perf_counter() - start
        stages.lap("commit")
        message = f"updated to version {version!r}"
        if len(txn.sources) > 1:
            message += f" ({txn.describe()})"
        if self.incomplete is not None:
            message += (f"; still incomplete: {len(self.damaged)} tensor(s) from the failed "
                        "update were not rewritten")
        return {"success": True, "message": message, "weight_version": version}

    def abort(self, why: str = "the weight update was aborted") -> dict:
        """Drop the open transaction. Nothing changes unless it wrote in place."""
        txn = self.open
        if txn is None:
            return {"success": True, "weight_version": self.serving.label,
                    "message": "no weight update is open: nothing to abort"}
        for piece in txn.waiting:
            piece.discard()
            piece.release()
        txn.waiting.clear()
        if txn.written:
            return self._fail(txn, f"{why} after writing {txn.describe()}")
        self._close(txn)
        return {"success": True, "weight_version": self.serving.label,
                "message": f"{why}; nothing was written ({txn.describe()})"}

    def _fail(self, txn: WeightUpdate, why: str) -> dict:
        """Pieces may be half-written: the weights are incomplete until rewritten."""
        for piece in txn.waiting:
            piece.discard()
            piece.release()
        txn.waiting.clear()
        self.runner.weights_changed()  # whatever was written, derived copies are stale
        self.damaged |= txn.written
        self.incomplete = why
        self.scheduler.abort_all(FinishReason.aborted("update_failed", why))
        self._close(txn)
        return {"success": False, "message": why, "weight_version": self.serving.label}

    def _close(self, txn: WeightUpdate) -> None:
        self.open = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if txn.holds_generation and not txn.was_paused:
            self.scheduler.resume()

    def close(self) -> None:
        """Shutdown: the expiry timer stops (an open transaction dies with the engine)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # versions

    def serve(self, version: str, written: Iterable[str]) -> None:
        """New weights serve as `version`: every cached prefix was computed with the old ones
        and retires, even under the same label (invariant 1). Serving resumes only once every
        tensor a failed update touched has been rewritten (`written` now has been)."""
        self.serving.label = version
        self.serving.epoch += 1
        epoch = self.serving.epoch
        self.scheduler.retire_namespaces(lambda ns: ns.weight_epoch != epoch)
        written = set(written)
        self.damaged -= written
        if self.scheduler.spec is not None:  # a learned draft: current or stale from now on
            self.scheduler.spec.weights_served(version, written)
        if not self.damaged:
            self.incomplete = None

    def _next_version(self, requested: str | None) -> str:
        return requested if requested is not None else self.proposed_version()

    def proposed_version(self) -> str:
        """The version a commit with weight_version=None would get now (not reserved): one
        that orders after the serving one (weight_sync/versions.py), so two such commits in a
        row never share one."""
        return next_version(self.serving.label)

    # expiry

    def _arm(self, txn: WeightUpdate, after_s: float | None = None) -> None:
        self._timer = threading.Timer(after_s or self._timeout_s, self._expire, (txn,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, txn: WeightUpdate) -> None:
        def on_thread() -> None:
            if self.open is not txn:
                return
            idle = time.monotonic() - txn.touched
            if idle < self._timeout_s:
                self._arm(txn, self._timeout_s - idle)
                return
            self.abort(f"the weight update was left open for over {self._timeout_s:g} s "
                       "(weight_update_timeout_s) and was aborted")

        with contextlib.suppress(Exception):  # the engine shut down meanwhile: nothing is open
            self.scheduler.run(on_thread)

