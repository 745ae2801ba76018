"""Two-phase weight updates: prepare (receive + validate into staging), then commit or abort.

A coordinator that updates several engines (a WeightSender with several targets, the Router)
must not leave them on different versions. Phase one, `prepare`, receives and validates the
whole update into a staging copy while the engine keeps serving the old weights; only when
every engine has prepared does the coordinator send `commit` (a normal update transaction from
the staged tensors), otherwise `abort` everywhere. The cost is one extra copy of the update in
memory between the two phases: from a process group, the standby buffer (standby.py), checked
for NaN and inf as it lands, so the commit is a swap; from disk, the tensors read; from tensors
(a Ray fleet's object store), a reference to them.

This is not the "staged update" that gathers several update calls into one version; it holds
exactly one prepared update, and a new prepare replaces an older one that was never committed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hotswap.engine.models.loader import iter_checkpoint, read_checkpoint_meta
from hotswap.engine.weights.receive import Landed

if TYPE_CHECKING:
    from hotswap.engine.weights.weight_manager import WeightManager


class PreparedUpdate:
    """At most one received-and-validated update, waiting for commit or abort."""

    def __init__(self, weights: WeightManager):
        self.weights = weights
        self._lock = threading.Lock()
        self._tensors: list[tuple[str, torch.Tensor]] | Landed | _OnRanks | None = None
        self._source = ""

    @property
    def pending(self) -> bool:
        return self._tensors is not None

    def from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                         shapes: Sequence[Sequence[int]], group_name: str,
                         load_format: str | None) -> dict:
        group = self.weights.group(group_name)
        self.weights.check_broadcast(group, names, dtypes, shapes, load_format)
        if hasattr(self.weights.runner, "receive_update"):  # tensor parallel: on every rank
            self.weights.receive_on_ranks(names, dtypes, shapes, group_name, load_format)
            return self._stage(_OnRanks(list(names)), f"{len(names)} tensor(s) from group "
                               f"{group_name!r} on every tensor-parallel rank")
        # Into the standby, each tensor checked as it lands: the commit is a swap.
        landed = self.weights.receive(group, names, dtypes, shapes, load_format)
        return self._stage(landed, f"{len(names)} tensor(s) from group {group_name!r}")

    def from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping) -> dict:
        """(HF name, tensor) pairs, a subset of the weights, validated and checked now (a
        coordinator that has the tensors in hand, e.g. from Ray's object store)."""
        items = self.weights.tensor_items(named_tensors)
        self.weights.check_values(items)
        return self._stage(items, f"{len(items)} tensor(s)")

    def from_disk(self, model_path: str) -> dict:
        self.weights.validate(read_checkpoint_meta(model_path), complete=True)
        known = self.weights.runner.weight_map  # validation passed: the rest are ignored buffers
        tensors = [(n, t) for n, t in iter_checkpoint(model_path) if n in known]
        self.weights.check_values(tensors)  # refused now, not at a commit the others made
        return self._stage(tensors, f"checkpoint {model_path!r}")

    def _stage(self, tensors: list[tuple[str, torch.Tensor]] | Landed | _OnRanks, source: str
               ) -> dict:
        with self._lock:
            old, self._tensors, self._source = self._tensors, tensors, source
        _drop(old)
        return {"success": True, "message": f"prepared {source}",
                "weight_version": self.weights.proposed_version()}

    def commit(self, weight_version: str | None, pause_mode: str) -> dict:
        """Applies the prepared update as one transaction; nothing prepared is a ValueError."""
        with self._lock:
            tensors, self._tensors = self._tensors, None
        if tensors is None:
            raise ValueError("no prepared weight update to commit; call a prepare method first")
        if isinstance(tensors, _OnRanks):
            return self.weights.commit_received(tensors.names, weight_version, pause_mode)
        if isinstance(tensors, Landed):
            return self.weights.install(tensors, weight_version, pause_mode)
        # Checked for NaN and inf when prepared (from_tensors, from_disk): not scanned again.
        return self.weights.update_from_tensor(tensors, weight_version, pause_mode,
                                               values_checked=True)

    def abort(self) -> dict:
        with self._lock:
            had, self._tensors = self._tensors, None
        if isinstance(had, _OnRanks):
            self.weights.runner.drop_received()
        _drop(had)
        message = (f"dropped the prepared {self._source}" if had is not None
                   else "nothing was prepared")
        return {"success": True, "message": message, "weight_version": self.weights.version}


def _drop(prepared: object) -> None:
    if isinstance(prepared, Landed):
        prepared.drop()  # gives the standby back


@dataclass(frozen=True)
class _OnRanks:
    """A prepared update that each tensor-parallel rank holds (its shards), not this process."""

    names: list[str]
