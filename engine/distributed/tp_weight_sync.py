"""Weight updates from a trainer's process group under tensor parallelism.

Every rank of the engine joins the trainer's group itself, at `rank_offset + tp_rank` (SGLang's
convention: the trainer's world size counts 1 + tp_size ranks per engine), receives every
broadcast full tensor and keeps only its shard; nothing is forwarded through rank 0. An update
is all-or-none over the ranks: each rank receives and checks its shards into a staging dict,
the ranks then exchange their outcomes, and only when every rank succeeded are the shards
written (a second command); otherwise every rank drops its staging and the weights and the
version stay as they were. Rank 0 drives each step with one command to the workers; the
workers run the same methods from their command loop. Forwards wait while a join or a receive
holds the TP group (the workers are busy with the trainer's broadcast).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from contextlib import closing
from typing import TYPE_CHECKING, Any

import torch

from hotswap.engine.errors import WorkerDiedError
from hotswap.engine.models.loader import check_finite, is_ignored
from hotswap.weight_sync.group import WeightGroup, WeightSyncError, init_process_group
from hotswap.weight_sync.receiver import discard_tensors, receive_tensors

if TYPE_CHECKING:
    from hotswap.engine.distributed.tp_group import TPGroup

log = logging.getLogger(__name__)

Outcome = tuple[str, str] | None  # None: this rank succeeded; else (kind, why)
Spec = tuple[Sequence[str], Sequence[str], Sequence[Sequence[int]], str | None]


class RankWeightSync:
    """What every rank does (mixed into the TP runners, which provide group, shard, local_map,
    tp_rank, device and dtype)."""

    group: TPGroup
    tp_rank: int
    local_map: dict[str, Any]
    device: torch.device

    def _init_weight_sync(self) -> None:
        self.weight_groups: dict[str, WeightGroup] = {}
        self.received: dict[str, torch.Tensor] | None = None

    def _join(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
              group_name: str, backend: str, timeout_s: float) -> Outcome:
        self._leave(group_name)  # a rank left behind by a failed join of another rank
        try:
            self.weight_groups[group_name] = init_process_group(
                master_address, master_port, rank_offset + self.tp_rank, world_size, group_name,
                backend, timeout_s, device=self.device)
        except Exception as exc:  # noqa: BLE001 - every rank's outcome is exchanged
            return _outcome(exc)
        return None

    def _leave(self, group_name: str) -> None:
        group = self.weight_groups.pop(group_name, None)
        if group is not None:
            group.destroy()

    def _receive(self, group_name: str, spec: Spec, check: bool) -> Outcome:
        """Receive every full tensor, keep this rank's shard (checked finite when asked)."""
        self.received = None
        group = self.weight_groups.get(group_name)
        if group is None:
            return ("value", f"no weight update group {group_name!r} on this rank")
        staged: dict[str, torch.Tensor] = {}
        try:
            with closing(receive_tensors(group, *spec, device=self.device)) as stream:
                for name, full in stream:
                    if is_ignored(name):
                        continue
                    part = self.shard(name, full)
                    if check:
                        check_finite([(name, part)])
                    staged[name] = part.to(self.local_map[name].view.dtype, copy=True)
        except Exception as exc:  # noqa: BLE001 - closing() kept this rank in step
            return _outcome(exc)
        self.received = staged
        return None

    def _discard(self, group_name: str, spec: Spec) -> None:
        group = self.weight_groups.get(group_name)
        if group is None:
            return
        try:
            discard_tensors(group, *spec)
        except WeightSyncError as exc:
            log.warning("discarding a refused update failed: %s", exc)

    def _apply_received(self) -> Outcome:
        staged, self.received = self.received, None
        if staged is None:
            return ("value", "no received weight update to apply")
        try:
            with torch.no_grad():
                for name, part in staged.items():
                    self.local_map[name].view.copy_(part)
        except Exception as exc:  # noqa: BLE001 - reported; the update then failed mid-write
            return _outcome(exc)
        return None

    def _agree(self, outcome: Outcome) -> dict[int, tuple[str, str]]:
        """Every rank's failure (rank -> (kind, why)); the same dict on every rank."""
        return {rank: o for rank, o in enumerate(self.group.exchange(outcome)) if o is not None}


class WeightSyncDriver:
    """Rank 0's side: one command to the workers, its own part, then the agreement. The caller
    (TPModelRunner) serializes these with forwards."""

    def join_weight_group(self, master_address: str, master_port: int, rank_offset: int,
                          world_size: int, group_name: str, backend: str,
                          timeout_s: float) -> WeightGroup:
        args = (master_address, master_port, rank_offset, world_size, group_name, backend,
                timeout_s)
        with self._exclusive():
            self._command("join", *args)
            failures = self._agree(self._join(*args))
            if failures:
                self._leave(group_name)
                _raise(failures, f"joining weight update group {group_name!r}")
            return self.weight_groups[group_name]

    def leave_weight_group(self, group_name: str) -> None:
        with self._exclusive():
            self._leave(group_name)
            with contextlib.suppress(WorkerDiedError):  # a dead engine has no group to leave
                self._command("leave", group_name)

    def receive_update(self, group_name: str, spec: Spec, check: bool) -> None:
        """Every rank receives and keeps its shards; raises on every failure of any rank, and
        then no rank keeps anything."""
        with self._exclusive():
            self._command("receive", group_name, spec, check)
            failures = self._agree(self._receive(group_name, spec, check))
            if failures:
                self.received = None
                _raise(failures, "receiving the update")

    def discard_update(self, group_name: str, spec: Spec) -> None:
        """Every rank takes part in a broadcast it refused, so the trainer finishes."""
        with self._exclusive():
            self._command("discard", group_name, spec)
            self._discard(group_name, spec)

    def apply_received(self) -> None:
        with self._exclusive():
            self._command("apply_received")
            failures = self._agree(self._apply_received())
            self.weights_changed()
            if failures:
                _raise(failures, "writing the received update")

    def drop_received(self) -> None:
        with self._exclusive():
            self.received = None
            self._command("drop_received")


class WeightSyncWorker:
    """The workers' command handlers (RankWeightSync's methods, outcomes exchanged)."""

    def _do_join(self, *args: Any) -> None:
        if self._agree(self._join(*args)):
            self._leave(args[4])

    def _do_leave(self, group_name: str) -> None:
        self._leave(group_name)

    def _do_receive(self, group_name: str, spec: Spec, check: bool) -> None:
        if self._agree(self._receive(group_name, spec, check)):
            self.received = None

    def _do_discard(self, group_name: str, spec: Spec) -> None:
        self._discard(group_name, spec)

    def _do_apply_received(self) -> None:
        outcome = self._apply_received()
        self.weights_changed()
        self._agree(outcome)

    def _do_drop_received(self) -> None:
        self.received = None


def _outcome(exc: BaseException) -> tuple[str, str]:
    return ("value" if isinstance(exc, ValueError) else "sync", f"{type(exc).__name__}: {exc}")


def _raise(failures: dict[int, tuple[str, str]], what: str) -> None:
    """ValueError (HTTP 400) when a rank refused the data; WeightSyncError for transport."""
    detail = "; ".join(f"rank {rank}: {why}" for rank, (_, why) in sorted(failures.items()))
    message = f"{what} failed on {len(failures)} tensor-parallel rank(s), so on all: {detail}"
    if any(kind == "value" for kind, _ in failures.values()):
        raise ValueError(message)
    raise WeightSyncError(message)
