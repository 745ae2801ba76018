"""WeightManager: every route of a weight update, as a thin call onto one transaction.

Each route validates the update against the model's HF weight map (names, shapes, dtypes) and
its arguments before any piece exists, checks the values (no NaN or inf) as they arrive, and
hands the piece to the one weight-update transaction (transaction.py), which holds, commits or
aborts it on the scheduler thread:
- update_from_tensor / _disk / _distributed (SGLang's calls): a piece written in place; with
  commit=False it joins an update that holds generation until commit();
- prepare_from_tensor / _disk / _distributed: a piece received beside the live weights while
  serving goes on, installed by commit();
- commit() / abort(): end whichever update is open.
The manager also owns the trainers' process groups and the weights' memory (release, resume,
the host copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hotswap.engine.client.protocol import check_pause_mode, check_staging
from hotswap.engine.core.namespace import ServingVersion
from hotswap.engine.core.request import FinishReason
from hotswap.engine.executor.omp import release_thread_team
from hotswap.engine.models.loader import (
    check_finite,
    check_weights,
    covered_names,
    is_ignored,
    iter_checkpoint,
    read_checkpoint_meta,
    write_weights,
)
from hotswap.engine.weights.receive import (
    Landed,
    Stages,
    non_finite_message,
    one_thread,
    receive_in_place,
    receive_to_standby,
)
from hotswap.engine.weights.standby import Standby
from hotswap.engine.weights.transaction import Piece, Transactions, WeightUpdate
from hotswap.weight_sync import group as ws_group
from hotswap.weight_sync.bucket import str_to_dtype
from hotswap.weight_sync.delta import Delta, check_delta, receive_delta
from hotswap.weight_sync.receiver import check_load_format, discard_tensors

if TYPE_CHECKING:
    from hotswap.engine.executor.model_runner import ModelRunner
    from hotswap.engine.scheduler.scheduler import Scheduler

Named = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


class WeightManager:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, serving: ServingVersion):
        self.runner = runner
        self.scheduler = scheduler
        self.transactions = Transactions(runner, scheduler, serving)
        self._serving = serving
        self._groups: dict[str, ws_group.WeightGroup] = {}
        self.keep_host_copy = bool(getattr(runner.config, "enable_weights_cpu_backup", False))
        self._host_copy: dict[str, torch.Tensor] | None = None
        check_staging(runner.config.weight_staging, "weight_staging")
        self.standby = Standby(runner)  # its buffer is allocated on first use
        self.last_stages: dict[str, float] = {}  # seconds per stage of the last update

    @property
    def version(self) -> str:
        return self._serving.label

    @property
    def open_update(self) -> WeightUpdate | None:
        return self.transactions.open

    @property
    def incomplete(self) -> str | None:
        return self.transactions.incomplete

    @property
    def last_update_s(self) -> float | None:
        return self.transactions.last_update_s

    def close(self) -> None:
        self.transactions.close()
        for name in list(self._groups):
            self.destroy_group(name)

    def check_servable(self) -> None:
        self.transactions.check_servable()

    def check_none_open(self, what: str) -> None:
        """ValueError while an update is open (`what` names the refused call)."""
        self.transactions.check_none_open(what)

    def pause_generation(self, mode: str) -> dict:
        """The user's pause, on the scheduler thread: an open update then leaves generation
        paused when it ends."""
        return self.scheduler.run(lambda: self.transactions.pause_generation(mode))

    # weight memory (scheduler thread, inside Scheduler.run, after the scheduler's own checks)

    def release_weights(self) -> None:
        if self.runner.weights_released:
            return
        if self.keep_host_copy and self.incomplete is None:
            self._host_copy = self.host_copy()
        self.runner.release_weights()
        self.standby.free()
        self.transactions.damaged = set(self.runner.model.required_weight_names())
        self.transactions.incomplete = ("weights were released by release_memory_occupation; "
                                        "resume them and push a complete update")

    def resume_weights(self) -> None:
        self.runner.resume_weights()
        copy, self._host_copy = self._host_copy, None
        if copy is None or self.runner.weights_released:
            return
        write_weights(self.runner.weight_map, copy.items())
        self.runner.weights_changed()
        self.transactions.damaged.clear()
        self.transactions.incomplete = None

    def host_copy(self) -> dict[str, torch.Tensor]:
        """Every weight under its HF name, once (aliases of other names left out)."""
        return {name: slot.view.detach().to("cpu", copy=True)
                for name, slot in self.runner.weight_map.items()
                if not getattr(slot, "covers", None)}

    # reads

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        slot = self.runner.weight_map.get(name)
        if slot is None:
            raise ValueError(f"unknown weight name {name!r}")
        return self.scheduler.run(lambda: slot.view[:truncate_size].float().cpu().tolist())

    # routes: SGLang's one-call updates (commit=False: pieces of one update)

    def update_from_tensor(self, named_tensors: Named | Delta, weight_version: str | None,
                           pause_mode: str, commit: bool = True) -> dict:
        check_update_args(weight_version, pause_mode)
        if isinstance(named_tensors, Delta):
            return self._submit(self._delta_piece(named_tensors, "a delta", "in_place"),
                                "in_place", weight_version, pause_mode, commit)
        items = self.tensor_items(named_tensors, "in_place")
        return self._submit(self._piece([n for n, _ in items], lambda: self._write(items),
                                        f"{len(items)} tensor(s)"),
                            "in_place", weight_version, pause_mode, commit)

    def update_from_disk(self, model_path: str, weight_version: str | None,
                         pause_mode: str, commit: bool = True) -> dict:
        check_update_args(weight_version, pause_mode)
        meta = self._checkpoint_meta(model_path, "in_place")
        self.check_values(iter_checkpoint(model_path))  # reads the data once before the write
        return self._submit(self._piece(list(meta),
                                        lambda: self._write(iter_checkpoint(model_path)),
                                        f"checkpoint {model_path!r}"),
                            "in_place", weight_version, pause_mode, commit)

    def update_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                shapes: Sequence[Sequence[int]], group_name: str,
                                weight_version: str | None, pause_mode: str,
                                load_format: str | None, commit: bool = True,
                                staging: str | None = None) -> dict:
        """staging "standby": received and checked beside the live weights, then swapped in;
        "none": received in place (see receive.py); None: the engine's weight_staging. Tensor
        parallel ranks always receive beside their shards (all-or-none), so they refuse "none"."""
        stages = Stages()
        group = self.group(group_name)

        def check_arguments() -> None:
            check_update_args(weight_version, pause_mode)
            if staging is not None:
                check_staging(staging)
            if staging == "none" and self.runner.tensor_parallel:
                raise ValueError("staging='none' is not available with tensor parallelism: "
                                 "every rank receives beside its shards so that all or none "
                                 "commit; use 'standby' or None")
            self._check_open_allows("in_place")
            if load_format == "delta":
                self._check_delta_meta(names, dtypes)

        self.check_broadcast(group, names, dtypes, shapes, load_format, check_arguments)
        stages.lap("validate")
        try:
            piece = self._receive(group, names, dtypes, shapes, load_format,
                                  staging or self.runner.config.weight_staging, stages)
            stages.lap("receive")
        except ws_group.WeightSyncError as err:
            return {"success": False, "weight_version": self.version,
                    "message": f"receiving the update failed, nothing was written: {err}"}
        return self._submit(piece, "in_place", weight_version, pause_mode, commit, stages)

    # routes: two phases (a coordinator prepares every engine, then commits or aborts them all)

    def prepare_from_tensor(self, named_tensors: Named | Delta) -> dict:
        """(HF name, tensor) pairs, a subset of the weights, or a Delta, validated and checked
        now and kept by reference until the commit (a coordinator with the tensors in hand:
        Ray's store)."""
        if isinstance(named_tensors, Delta):
            return self._prepare(self._delta_piece(named_tensors, "a delta", "standby"))
        items = self.tensor_items(named_tensors, "standby")
        return self._prepare(self._piece([n for n, _ in items], lambda: self._write(items),
                                         f"{len(items)} tensor(s)"))

    def prepare_from_disk(self, model_path: str) -> dict:
        self._checkpoint_meta(model_path, "standby")
        known = self.runner.weight_map  # validation passed: the rest are ignored buffers
        tensors = [(n, t) for n, t in iter_checkpoint(model_path) if n in known]
        self.check_values(tensors)  # refused now, not at a commit the others made
        return self._prepare(self._piece([n for n, _ in tensors],
                                         lambda: self._write(tensors),
                                         f"checkpoint {model_path!r}"))

    def prepare_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                 shapes: Sequence[Sequence[int]], group_name: str,
                                 load_format: str | None) -> dict:
        """Into the standby (or every tensor-parallel rank's), each tensor checked as it lands:
        the commit is a swap."""
        group = self.group(group_name)

        def check_arguments() -> None:
            self._check_open_allows("standby")
            if load_format == "delta":
                self._check_delta_meta(names, dtypes)

        self.check_broadcast(group, names, dtypes, shapes, load_format, check_arguments)
        return self._prepare(self._receive(group, names, dtypes, shapes, load_format,
                                           "standby", Stages()))

    def commit(self, weight_version: str | None, pause_mode: str | None) -> dict:
        """The open update becomes one version; ValueError when none is open."""
        check_update_args(weight_version, pause_mode or "retract")
        stages = Stages()
        try:
            return self.scheduler.run(
                lambda: self.transactions.commit(weight_version, pause_mode, stages))
        finally:
            self.last_stages = stages.seconds

    def abort(self) -> dict:
        return self.scheduler.run(self.transactions.abort)

    def relabel(self, new_version: str, abort_all: bool) -> dict:
        """Scheduler thread: a new label for the same weights; old namespaces retire.
        ValueError while an update is open."""
        self.check_none_open("relabelling the weights")
        if abort_all:
            self.scheduler.abort_all(FinishReason.aborted(
                "relabelled", "aborted: weight version relabelled"))
        self._serving.label = new_version
        self.scheduler.retire_namespaces(lambda ns: ns.weight_version != new_version)
        return {"success": True, "message": f"weight version is now {new_version!r}"}

    def _prepare(self, piece: Piece) -> dict:
        return self._submit(piece, "standby", None, "retract", commit=False)

    def _submit(self, piece: Piece, storage: str, requested: str | None, pause_mode: str,
                commit: bool, stages: Stages | None = None) -> dict:
        stages = stages or Stages()
        try:
            return self.scheduler.run(lambda: self.transactions.add(
                piece, storage, requested, pause_mode, commit, stages))
        finally:
            self.last_stages = stages.seconds

    def _piece(self, names: Iterable[str], install: Callable[[], None], source: str,
               **ends: Any) -> Piece:
        # The names whose storage this writes (an alias: the names it covers, e.g. an MoE
        # model's stacked experts); ignored buffers are never written, so never damaged.
        covered = covered_names(self.runner.weight_map, (n for n in names if not is_ignored(n)))
        return Piece(sorted(covered), install, source, **ends)

    def _delta_piece(self, delta: Delta, source: str, storage: str) -> Piece:
        """A delta's piece; its base version is checked by the transaction (storage: checks
        made here before it, or "" when _check_delta_meta ran before the broadcast)."""
        specs = delta.specs
        if storage:
            self.validate_update([s.name for s in specs], [s.dtype for s in specs],
                                 [s.shape for s in specs])
            self._check_open_allows(storage)
            self._check_delta_meta([s.name for s in specs], [s.dtype for s in specs])
            check_delta(delta)
        bad = delta.non_finite() if self.runner.config.check_weights_finite else []
        if bad:
            raise ValueError(non_finite_message(bad))
        weight_map = self.runner.weight_map

        def install() -> None:  # the views now: a standby swap may have moved the weights
            delta.apply({s.name: weight_map[s.name].view for s in specs
                         if not is_ignored(s.name)})

        changed = f"{delta.changed_elements():,} element(s) changed, {delta.nbytes:,} bytes"
        return self._piece([s.name for s in specs], install, f"{source} ({changed})",
                           base_version=delta.base_version)

    def _check_delta_meta(self, names: Sequence[str], dtypes: Sequence[Any]) -> None:
        """A delta carries values in the weights' own dtype (rounded as a full push would
        round them), and tensor-parallel ranks take full pushes only."""
        if self.runner.tensor_parallel:
            raise ValueError("delta updates are not available with tensor parallelism; push "
                             "the full weights")
        wrong = [n for n, d in zip(names, dtypes) if not is_ignored(n)
                 and _dtype_or_none(d) != self.runner.weight_map[n].view.dtype]
        if wrong:
            raise ValueError(f"a delta must be in the weights' dtype "
                             f"({self.runner.dtype}); {wrong[:3]} are not")

    def _check_open_allows(self, storage: str) -> None:
        """The early form of the transaction's own check: refused before the data moves."""
        txn = self.open_update
        if txn is not None and (storage == "standby" or not txn.holds_generation):
            raise ValueError(f"a weight update is open ({txn.describe()}); commit or abort it "
                             "first")

    # process groups

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str) -> dict:
        if group_name in self._groups:
            raise ValueError(f"weight update group {group_name!r} exists; destroy it first")
        timeout_s = self.runner.config.weight_update_timeout_s
        if self.runner.tensor_parallel:  # each rank joins at rank_offset + its tp rank
            self._groups[group_name] = self.runner.join_weight_group(
                master_address, master_port, rank_offset, world_size, group_name, backend,
                timeout_s)
            last = rank_offset + self.runner.tp_size - 1
            return {"success": True,
                    "message": f"joined {group_name!r} as ranks {rank_offset}..{last}"}
        self._groups[group_name] = ws_group.init_process_group(
            master_address, master_port, rank_offset, world_size, group_name, backend,
            timeout_s=timeout_s, device=self.runner.device)
        return {"success": True, "message": f"joined {group_name!r} as rank {rank_offset}"}

    def group(self, group_name: str) -> ws_group.WeightGroup:
        group = self._groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}; "
                             "call init_weights_update_group first")
        return group

    def destroy_group(self, group_name: str) -> dict:
        group = self._groups.pop(group_name, None)
        if group is None:
            return {"success": False, "message": f"no weight update group {group_name!r}"}
        group.destroy()
        if self.runner.tensor_parallel:
            self.runner.leave_weight_group(group_name)
        return {"success": True, "message": f"destroyed {group_name!r}"}

    def discard(self, group: ws_group.WeightGroup, names: Sequence[str], dtypes: Sequence[str],
                shapes: Sequence[Sequence[int]], load_format: str | None) -> None:
        """Take part in a broadcast without keeping it (a refused update)."""
        if self.runner.tensor_parallel:
            self.runner.discard_update(group.name, (names, dtypes, shapes, load_format))
        else:
            discard_tensors(group, names, dtypes, shapes, load_format)

    # receiving a broadcast

    def _receive(self, group: ws_group.WeightGroup, names: Sequence[str],
                 dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                 load_format: str | None, staging: str, stages: Stages) -> Piece:
        """A validated broadcast as a piece: received now beside the weights (standby, or on
        every tensor-parallel rank), or received in place when the piece is installed."""
        source = f"{len(names)} tensor(s) from group {group.name!r}"
        if load_format == "delta":  # small: received now, written in place at the commit
            return self._delta_piece(receive_delta(group, names, dtypes, shapes),
                                     f"a delta of {source}", "")
        if self.runner.tensor_parallel:  # every rank keeps its shards; a failure raises here
            self.runner.receive_update(group.name, (list(names), list(dtypes),
                                                    [list(s) for s in shapes], load_format),
                                       self.runner.config.check_weights_finite)
            return self._piece(names, self.runner.apply_received, source + " on every rank",
                               discard=self.runner.drop_received)
        if staging == "standby":
            landed = self.receive(group, names, dtypes, shapes, load_format, stages)
            return self._piece(landed.names, landed.install, source, release=landed.drop)

        def in_place() -> None:
            with one_thread(), self.standby.borrow_landing() as landing:
                receive_in_place(group, self.runner.weight_map, names, dtypes, shapes,
                                 load_format, self.runner.config.check_weights_finite,
                                 self.runner.device, stages, landing)

        return self._piece(names, in_place, source, discard=lambda: discard_tensors(
            group, names, dtypes, shapes, load_format))

    def receive(self, group: ws_group.WeightGroup, names: Sequence[str], dtypes: Sequence[str],
                shapes: Sequence[Sequence[int]], load_format: str | None,
                stages: Stages | None = None) -> Landed:
        """A validated update received into the standby and checked; serving goes on."""
        try:
            with one_thread():
                return receive_to_standby(self.standby, group, names, dtypes, shapes,
                                          load_format, self.runner.config.check_weights_finite,
                                          stages or Stages())
        finally:
            release_thread_team()  # this thread's team would throttle the scheduler's

    # the one validation of an update's names, dtypes and shapes: every route calls these

    def validate(self, meta: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
                 complete: bool) -> None:
        if self.runner.weights_released:
            raise ValueError("weights are released: call resume_memory_occupation first")
        required = self.runner.model.required_weight_names() if complete else ()
        check_weights(self.runner.weight_map, meta, required)
        if not meta:
            raise ValueError("the update holds no tensors")

    def validate_update(self, names: Sequence[str], dtypes: Sequence[Any],
                        shapes: Sequence[Sequence[int]]) -> None:
        """A partial update (tensor, staged, distributed, two-phase): ValueError naming every
        bad name, shape or dtype."""
        self.validate(update_meta(names, dtypes, shapes), complete=False)

    def tensor_items(self, named_tensors: Named, storage: str) -> list[tuple[str, torch.Tensor]]:
        """An update's (name, tensor) pairs, validated against the model (names, shapes,
        dtypes) and checked for NaN and inf."""
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping)
                     else named_tensors)
        if any(not isinstance(t, torch.Tensor) for _, t in items):
            raise ValueError("named_tensors must hold torch.Tensor values")
        self.validate_update([n for n, _ in items], [t.dtype for _, t in items],
                             [t.shape for _, t in items])
        self._check_open_allows(storage)
        self.check_values(items)
        return items

    def _checkpoint_meta(self, model_path: str, storage: str
                         ) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        meta = read_checkpoint_meta(model_path)
        self.validate(meta, complete=True)
        self._check_open_allows(storage)
        return meta

    def check_values(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """ValueError naming every tensor with a NaN or inf (unless check_weights_finite=False)."""
        if self.runner.config.check_weights_finite:
            check_finite(named)

    def check_broadcast(self, group: ws_group.WeightGroup, names: Sequence[str],
                        dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                        load_format: str | None, also: Callable[[], Any] | None = None) -> None:
        """Validate an update before receiving it (and run `also`, more checks); on a
        ValueError take part in the broadcast anyway, discarding it, so the sender and the
        other targets finish instead of timing out."""
        check_load_format(load_format)
        try:
            self.validate_update(names, dtypes, shapes)
            if also is not None:
                also()
        except ValueError:
            self.discard(group, names, dtypes, shapes, load_format)
            raise

    def proposed_version(self) -> str:
        return self.transactions.proposed_version()

    def _write(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        write_weights(self.runner.weight_map, named)


def check_update_args(weight_version: str | None, pause_mode: str) -> None:
    check_pause_mode(pause_mode)
    if weight_version is not None and (not isinstance(weight_version, str)
                                       or not weight_version):
        raise ValueError("weight_version must be a non-empty string")


def update_meta(names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Sequence[int]]
                ) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """name -> (shape, dtype) of an update given as parallel lists (an unknown dtype: None)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes must have the same length, got "
                         f"{len(names)}, {len(dtypes)} and {len(shapes)}")
    meta: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        if name in meta:
            raise ValueError(f"the update repeats the name {name!r}")
        meta[name] = (tuple(shape), _dtype_or_none(dtype))
    return meta


def _dtype_or_none(name: Any) -> torch.dtype | None:
    try:
        return str_to_dtype(name)
    except (ValueError, TypeError, KeyError):
        return None
