"""WeightManager: the weight version, pause modes, and weight updates as transactions.

An update (from tensors, disk or a process group) is validated against the model's HF weight
map before any parameter is touched, and by default its values are checked (no NaN or inf)
before any write too: a process group's tensors land in the standby buffer first (receive.py).
Then, in the scheduler thread between steps: running requests are handled per pause mode, the
tensors are copied (or the standby swapped) into place, the version is bumped and every KV
namespace of older versions is retired. A failure before the first write leaves the old weights
and version serving; a failure after it marks the weights incomplete, aborts all work and makes
generation refuse until a complete update succeeds.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hotswap.engine.client.protocol import check_pause_mode, check_staging
from hotswap.engine.errors import WeightsIncompleteError
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
    one_thread,
    receive_in_place,
    receive_to_standby,
)
from hotswap.engine.weights.staging import Stage
from hotswap.engine.weights.standby import Standby
from hotswap.weight_sync import group as ws_group
from hotswap.weight_sync.bucket import str_to_dtype
from hotswap.weight_sync.receiver import check_load_format, discard_tensors

if TYPE_CHECKING:
    from hotswap.engine.executor.model_runner import ModelRunner
    from hotswap.engine.scheduler.scheduler import Scheduler


class WeightManager:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.version = "0"
        self.epoch = 0  # weight changes served so far (the cache namespaces' weight_epoch)
        self.incomplete: str | None = None  # why the weights are partly overwritten
        self._damaged: set[str] = set()  # names a failed update may have half-written
        self.last_update_s: float | None = None
        self._auto = itertools.count(1)
        self._groups: dict[str, ws_group.WeightGroup] = {}
        self.scheduler: Scheduler | None = None
        self.stage: Stage | None = None  # an open staged update (scheduler thread)
        self.keep_host_copy = bool(getattr(runner.config, "enable_weights_cpu_backup", False))
        self._host_copy: dict[str, torch.Tensor] | None = None
        check_staging(runner.config.weight_staging, "weight_staging")
        self.standby = Standby(runner)  # its buffer is allocated on first use
        self.last_stages: dict[str, float] = {}  # seconds per stage of the last update

    def attach(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def close(self) -> None:
        for name in list(self._groups):
            self.destroy_group(name)

    def check_servable(self) -> None:
        if self.incomplete is not None:
            raise WeightsIncompleteError(
                f"weights are incomplete ({self.incomplete}); generation is refused until an "
                "update rewrites every affected tensor")

    # weight memory (scheduler thread, inside Scheduler.run, after the scheduler's own checks)

    def release_weights(self) -> None:
        if self.runner.weights_released:
            return
        if self.keep_host_copy and self.incomplete is None:
            self._host_copy = self.host_copy()
        self.runner.release_weights()
        self.standby.free()
        self._damaged = self.runner.model.required_weight_names()
        self.incomplete = ("weights were released by release_memory_occupation; resume them "
                           "and push a complete update")

    def resume_weights(self) -> None:
        self.runner.resume_weights()
        self._restore_host_copy()

    # reads

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        slot = self.runner.weight_map.get(name)
        if slot is None:
            raise ValueError(f"unknown weight name {name!r}")
        return self.scheduler.run(lambda: slot.view[:truncate_size].float().cpu().tolist())

    # updates

    def _next_version(self, requested: str | None = None) -> str:
        """Scheduler thread only: two updates committed one after the other never share one."""
        if requested is not None:
            return requested
        return str(max(next(self._auto), _as_int(self.version) + 1))

    def _validate(self, meta: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
                  complete: bool) -> None:
        if self.runner.weights_released:
            raise ValueError("weights are released: call resume_memory_occupation first")
        required = self.runner.model.required_weight_names() if complete else ()
        check_weights(self.runner.weight_map, meta, required)
        if not meta:
            raise ValueError("the update holds no tensors")

    def tensor_items(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping
                     ) -> list[tuple[str, torch.Tensor]]:
        """An update's (name, tensor) pairs, validated against the model (names, shapes,
        dtypes); their values are not looked at."""
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping)
                     else named_tensors)
        if any(not isinstance(t, torch.Tensor) for _, t in items):
            raise ValueError("named_tensors must hold torch.Tensor values")
        self.validate_update([n for n, _ in items], [t.dtype for _, t in items],
                             [t.shape for _, t in items])
        return items

    def update_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping,
                           weight_version: str | None, pause_mode: str,
                           commit: bool = True, values_checked: bool = False) -> dict:
        """values_checked: the caller ran check_values on these tensors (a prepared update),
        so the NaN/inf pass over them is not made again."""
        items = self.tensor_items(named_tensors)
        self._prepare(weight_version, pause_mode)
        if not values_checked:
            self.check_values(items)
        return self._commit(lambda: self._write(items), [n for n, _ in items], weight_version,
                            pause_mode, commit)

    def update_from_disk(self, model_path: str, weight_version: str | None,
                         pause_mode: str, commit: bool = True) -> dict:
        meta = read_checkpoint_meta(model_path)
        self._validate(meta, complete=True)
        self._prepare(weight_version, pause_mode)
        self.check_values(iter_checkpoint(model_path))  # reads the data once before the write
        return self._commit(lambda: self._write(iter_checkpoint(model_path)), list(meta),
                            weight_version, pause_mode, commit)

    def check_values(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """ValueError naming every tensor with a NaN or inf (unless check_weights_finite=False)."""
        if self.runner.config.check_weights_finite:
            check_finite(named)

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str) -> dict:
        if group_name in self._groups:
            raise ValueError(f"weight update group {group_name!r} exists; destroy it first")
        timeout_s = self.runner.config.weight_update_timeout_s
        join = getattr(self.runner, "join_weight_group", None)
        if join is not None:  # tensor parallel: each rank joins at rank_offset + its tp rank
            self._groups[group_name] = join(master_address, master_port, rank_offset, world_size,
                                            group_name, backend, timeout_s)
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
        if hasattr(self.runner, "leave_weight_group"):  # tensor parallel: the workers' ranks
            self.runner.leave_weight_group(group_name)
        return {"success": True, "message": f"destroyed {group_name!r}"}

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
        tensor_parallel = hasattr(self.runner, "receive_update")

        def check_arguments() -> None:
            self._prepare(weight_version, pause_mode)
            if staging is not None:
                check_staging(staging)
            if staging == "none" and tensor_parallel:
                raise ValueError("staging='none' is not available with tensor parallelism: "
                                 "every rank receives beside its shards so that all or none "
                                 "commit; use 'standby' or None")

        self.check_broadcast(group, names, dtypes, shapes, load_format, check_arguments)
        stages.lap("validate")
        if tensor_parallel:  # every rank receives
            self.receive_on_ranks(names, dtypes, shapes, group_name, load_format)
            return self.commit_received(list(names), weight_version, pause_mode, commit)
        if (staging or self.runner.config.weight_staging) == "standby":
            try:
                landed = self.receive(group, names, dtypes, shapes, load_format, stages)
            except ws_group.WeightSyncError as err:
                return {"success": False, "weight_version": self.version,
                        "message": f"receiving the update failed, nothing was written: {err}"}
            return self.install(landed, weight_version, pause_mode, commit, stages)

        def apply() -> None:
            with one_thread():
                receive_in_place(group, self.runner.weight_map, names, dtypes, shapes,
                                 load_format, self.runner.config.check_weights_finite,
                                 self.runner.device, stages)

        return self._commit(apply, list(names), weight_version, pause_mode, commit, stages)

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

    def install(self, landed: Landed, weight_version: str | None, pause_mode: str,
                commit: bool = True, stages: Stages | None = None) -> dict:
        """Commit a received update: a swap (or a copy, when small) under the pause mode."""
        try:
            self._prepare(weight_version, pause_mode)
            return self._commit(landed.install, landed.names, weight_version, pause_mode, commit,
                                stages)
        finally:
            landed.drop()

    # tensor parallel (engine/distributed/tp_weight_sync.py): all ranks receive, all or none

    def discard(self, group: ws_group.WeightGroup, names: Sequence[str], dtypes: Sequence[str],
                shapes: Sequence[Sequence[int]], load_format: str | None) -> None:
        if hasattr(self.runner, "discard_update"):
            self.runner.discard_update(group.name, (names, dtypes, shapes, load_format))
        else:
            discard_tensors(group, names, dtypes, shapes, load_format)

    def receive_on_ranks(self, names: Sequence[str], dtypes: Sequence[str],
                         shapes: Sequence[Sequence[int]], group_name: str,
                         load_format: str | None) -> None:
        """Every rank receives and keeps its shards; a failure on any rank raises here and
        leaves the weights as they were on every rank."""
        self.runner.receive_update(group_name, (list(names), list(dtypes),
                                                [list(s) for s in shapes], load_format),
                                   self.runner.config.check_weights_finite)

    def commit_received(self, names: list[str], weight_version: str | None, pause_mode: str,
                        commit: bool = True) -> dict:
        return self._commit(self.runner.apply_received, names, weight_version, pause_mode, commit)

    # the one validation of an update's names, dtypes and shapes: every path calls these

    def validate(self, meta: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
                 complete: bool) -> None:
        self._validate(meta, complete)

    def validate_update(self, names: Sequence[str], dtypes: Sequence[Any],
                        shapes: Sequence[Sequence[int]]) -> None:
        """A partial update (tensor, staged, distributed, two-phase): ValueError naming every
        bad name, shape or dtype."""
        self._validate(update_meta(names, dtypes, shapes), complete=False)

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
        """The version an update with weight_version=None would get now (not reserved)."""
        return str(_as_int(self.version) + 1)

    def _write(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        write_weights(self.runner.weight_map, named)

    @staticmethod
    def _prepare(weight_version: str | None, pause_mode: str) -> str | None:
        """Check the remaining arguments; returns the requested version (None: automatic,
        chosen at commit)."""
        check_pause_mode(pause_mode)
        if weight_version is not None and (not isinstance(weight_version, str)
                                           or not weight_version):
            raise ValueError("weight_version must be a non-empty string")
        return weight_version

    def _commit(self, apply: Callable[[], None], names: list[str], requested: str | None,
                pause_mode: str, commit: bool = True, stages: Stages | None = None) -> dict:
        # The names whose storage this writes (an alias: the names it covers, e.g. an MoE
        # model's stacked experts); ignored buffers are never written, so never damaged.
        names = sorted(covered_names(self.runner.weight_map,
                                     (n for n in names if not is_ignored(n))))
        stages = stages or Stages()
        try:
            return self.scheduler.run(
                lambda: self._commit_now(apply, names, requested, pause_mode, commit, stages))
        finally:
            self.last_stages = stages.seconds

    def _commit_now(self, apply: Callable[[], None], names: list[str], requested: str | None,
                    pause_mode: str, commit: bool, stages: Stages) -> dict:
        """Scheduler thread: pause per mode, write, bump the version, retire old namespaces.
        With commit=False, or while a stage is open, the write joins the stage instead."""
        stages.lap("queue")
        if not commit or self.stage is not None:
            return self._stage_piece(apply, names, requested, pause_mode, commit)
        sched = self.scheduler
        start = time.perf_counter()
        version = self._next_version(requested)
        sched.apply_pause_mode(pause_mode)
        stages.lap("pause")
        try:
            apply()
            stages.lap("install")
            self.runner.weights_changed()
            self._quantize(stages)
        except Exception as exc:  # noqa: BLE001 - reported, and the engine refuses to serve
            self.runner.weights_changed()  # whatever was written, derived copies are stale
            self._damaged |= set(names)
            self.incomplete = f"update to version {version!r} failed while writing: {exc}"
            sched.abort_all(self.incomplete)
            return {"success": False, "message": self.incomplete, "weight_version": self.version}
        self._serve_new_weights(version, names)
        self.last_update_s = time.perf_counter() - start
        stages.lap("commit")
        message = f"updated to version {version!r}"
        if self.incomplete is not None:
            message += (f"; still incomplete: {len(self._damaged)} tensor(s) from the failed "
                        "update were not rewritten")
        return {"success": True, "message": message, "weight_version": version}

    def _quantize(self, stages: Stages | None = None) -> None:
        """quantization="int8": the int8 copies of the new weights, before the version bumps
        and generation resumes (a failure fails the update), then the other derived copies
        (stages "quantize" and "derive"). Other engines rebuild their packed copies at the next
        forward, as before."""
        if self.runner.config.quantization is not None:
            self.runner.refresh_derived(None if stages is None else stages.lap)

    # staged updates (scheduler thread; see staging.py)

    def _stage_piece(self, apply: Callable[[], None], names: list[str], requested: str | None,
                     pause_mode: str, commit: bool) -> dict:
        if self.stage is None:
            was_paused = self.scheduler.paused
            self.scheduler.pause(pause_mode)
            self.stage = Stage(pause_mode, was_paused=was_paused)
        self.stage.add(names, requested)
        try:
            apply()
        except Exception as exc:  # noqa: BLE001 - reported, and the engine refuses to serve
            self.runner.weights_changed()
            return self.abort_stage(f"writing a staged piece failed: {exc}")
        self.runner.weights_changed()
        if commit:
            return self.commit_stage(None)
        return {"success": True, "weight_version": self.version,
                "message": f"staged ({self.stage.describe()}); serving version "
                           f"{self.version!r} until the commit"}

    def commit_stage(self, weight_version: str | None) -> dict:
        """One version for everything staged; generation resumes (unless the user paused)."""
        stage = self.stage
        if stage is None:
            return {"success": True, "weight_version": self.version,
                    "message": "no staged weight update to commit"}
        version = self._next_version(self._prepare(weight_version or stage.weight_version,
                                                   stage.pause_mode))
        try:
            self._quantize()
        except Exception as exc:  # noqa: BLE001 - the pieces are written: refuse to serve
            self.runner.weights_changed()
            return self.abort_stage(f"quantizing the staged weights failed: {exc}")
        self.stage = None
        self._serve_new_weights(version, stage.written)
        if not stage.was_paused:
            self.scheduler.resume()
        return {"success": True, "weight_version": version,
                "message": f"updated to version {version!r} ({stage.describe()})"}

    def abort_stage(self, why: str = "the staged weight update was aborted") -> dict:
        """Drop the stage. Tensors it wrote are half a version: generation is refused until a
        complete update rewrites them."""
        stage, self.stage = self.stage, None
        if stage is None:
            return {"success": True, "weight_version": self.version,
                    "message": "no staged weight update to abort"}
        if stage.written:
            self._damaged |= stage.written
            self.incomplete = f"{why} after writing {stage.describe()}"
            self.scheduler.abort_all(self.incomplete)
        if not stage.was_paused:
            self.scheduler.resume()
        return {"success": False, "weight_version": self.version,
                "message": self.incomplete or why}

    def _serve_new_weights(self, version: str, written: Iterable[str]) -> None:
        """New weights serve as `version`: every cached prefix was computed with the old ones
        and retires, even under the same label (invariant 1). Serving resumes only once every
        tensor a failed update touched has been rewritten (`written` now has been)."""
        self.version = version
        self.epoch += 1
        epoch = self.epoch
        self.scheduler.retire_namespaces(lambda ns: ns.weight_epoch != epoch)
        self._damaged -= set(written)
        if not self._damaged:
            self.incomplete = None

    def relabel(self, new_version: str, abort_all: bool) -> dict:
        """Scheduler thread: a new label for the same weights; old namespaces retire."""
        if self.stage is not None:
            return {"success": False, "message": "a staged weight update is open"}
        if abort_all:
            self.scheduler.abort_all("aborted: weight version relabelled")
        self.version = new_version
        self.scheduler.retire_namespaces(lambda ns: ns.weight_version != new_version)
        return {"success": True, "message": f"weight version is now {new_version!r}"}

    # host copy across release_memory_occupation (enable_weights_cpu_backup)

    def host_copy(self) -> dict[str, torch.Tensor]:
        """Every weight under its HF name, once (aliases of other names left out)."""
        return {name: slot.view.detach().to("cpu", copy=True)
                for name, slot in self.runner.weight_map.items()
                if not getattr(slot, "covers", None)}

    def _restore_host_copy(self) -> None:
        copy, self._host_copy = self._host_copy, None
        if copy is None or self.runner.weights_released:
            return
        self._write(copy.items())
        self.runner.weights_changed()
        self._damaged.clear()
        self.incomplete = None


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


def _as_int(version: str) -> int:
    return int(version) if version.isdigit() else 0


def _dtype_or_none(name: Any) -> torch.dtype | None:
    try:
        return str_to_dtype(name)
    except (ValueError, TypeError, KeyError):
        return None
