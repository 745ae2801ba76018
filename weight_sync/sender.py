"""Trainer side: WeightSender tells every target to receive (RPC) and broadcasts as rank 0.

A target is anything with the engine's weight methods (init_weights_update_group,
update_weights_from_distributed, destroy_weights_update_group): an in-process Engine or a
RemoteEngine over HTTP. Each target takes one rank, or `target.weight_sync_ranks` consecutive
ranks when it fronts several engines (a Router, a RayFleet): target i starts after the ranks
before it. A fleet whose replicas change between sends gets a group re-formed for them.

Targets that report the dtype they keep their weights in (`weights_dtype`: Engine, RemoteEngine,
Router, RayFleet), all the same, get wider float tensors rounded to it before they travel, as
they would be on arrival (to nearest even): an fp32 trainer sends a bf16 engine half the bytes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hotswap.weight_sync.bucket import (
    TensorSpec,
    bucket_header,
    dtype_to_str,
    flatten_into,
    on_wire,
    plan_buckets,
    str_to_dtype,
)
from hotswap.weight_sync.delta import DeltaTracker, delta_stats, full_stats
from hotswap.weight_sync.group import (
    DEFAULT_TIMEOUT_S,
    WeightGroup,
    WeightSyncError,
    init_process_group,
    resolve_backend,
)
from hotswap.weight_sync.receiver import check_load_format
from hotswap.weight_sync.versions import newest

logger = logging.getLogger("hotswap.weight_sync")

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class _Call(threading.Thread):
    """One RPC in a daemon thread, so a target that never answers cannot block exit."""

    def __init__(self, fn: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.fn, self.kwargs = fn, kwargs
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn(**self.kwargs)
        except BaseException as err:
            self.error = err

    def failure(self, deadline: float) -> str | None:
        """Why the call failed (None: it succeeded), waiting for it until deadline (monotonic)."""
        self.join(max(0.0, deadline - time.monotonic()))
        if self.is_alive():
            return "no answer in time"
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        if not isinstance(self.result, Mapping):
            return f"unexpected reply {self.result!r}"
        if not self.result.get("success"):
            return str(self.result.get("message", "failed without a message"))
        return None


class WeightSender:
    """Rank 0 of a weight-update group; the targets hold ranks 1..world_size-1."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "auto",
        bucket_bytes: int = 512 << 20,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"world_size must count the trainer and its targets, got {world_size}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        resolve_backend(backend)
        self.master_address = master_address
        self.master_port = master_port
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group: WeightGroup | None = None
        self._members: tuple | None = None  # the targets' membership the group was made with
        self.delta: DeltaTracker | None = None  # what the targets hold (send(delta=True))
        # A CPU group's two bucket buffers, kept between sends: fresh ones are paged in while the
        # wire waits (CUDA's caching allocator keeps freed blocks anyway).
        self._flat: list[torch.Tensor | None] = [None, None]
        self.last_push: dict[str, Any] = {}  # {"kind": "full" | "delta", "bytes", ...}
        self.wire_dtype: torch.dtype | None = None  # the targets' weights dtype (connect)

    @property
    def connected(self) -> bool:
        return self.group is not None and self.group.alive

    def connect(self, targets: Sequence[Any], device: torch.device | str | None = None) -> None:
        """Creates the group with every target at once (each joins from its own RPC thread)."""
        if self.connected:
            return
        targets = list(targets)
        self._check_targets(targets)
        backend = resolve_backend(self.backend, device)
        calls = [
            _Call(t.init_weights_update_group, master_address=self.master_address,
                  master_port=self.master_port, rank_offset=offset, world_size=self.world_size,
                  group_name=self.group_name, backend=backend)
            for offset, t in zip(_rank_offsets(targets), targets, strict=True)
        ]
        try:
            group = init_process_group(self.master_address, self.master_port, 0, self.world_size,
                                       self.group_name, backend, self.timeout_s)
        except Exception as err:
            failures = _failures(calls, targets, self.timeout_s)
            raise WeightSyncError(f"creating group {self.group_name!r} failed: {err}; "
                                  f"targets: {failures}", failures) from err
        failures = _failures(calls, targets, self.timeout_s)
        if failures:
            group.destroy()
            raise WeightSyncError(f"targets failed to join {self.group_name!r}: {failures}",
                                  failures)
        self.group = group
        self._members = _membership(targets)
        self.wire_dtype = common_float_dtype(targets)

    def _follow_membership(self, targets: list[Any]) -> None:
        """A fleet whose replicas changed since the group was made (one died, joined or
        left): the group is re-formed for the replicas it has now, at the next send."""
        if self._members is None or _membership(targets) == self._members:
            return
        try:
            self.close(targets)
        except WeightSyncError as err:
            logger.warning("re-forming %r: %s", self.group_name, err)
        self._members = None
        self.world_size = 1 + sum(_ranks_of(t) for t in targets)

    def send(
        self,
        named_tensors: NamedTensors,
        targets: Sequence[Any],
        weight_version: str | None = None,
        load_format: str | None = "flattened_bucket",
        flush_cache: bool = True,
        pause_mode: str = "retract",
        lora_name: str | None = None,
        staging: str | None = None,
        delta: bool = False,
    ) -> list[dict]:
        """Returns every target's reply once all applied the update; raises WeightSyncError
        naming each target that did not. Tensors travel in the trainer's dtypes, except float
        tensors wider than the dtype every target reports keeping its weights in
        (`wire_dtype`), which are rounded to it first, as the targets would round them.

        One target receives straight into its weights. Several targets update in two phases
        (all receive and validate into staging, then all commit; on any failure all abort), so
        they never end on different versions; each must have the engine's prepare/commit/abort
        methods (Engine, RemoteEngine). With `lora_name` the tensors are that LoRA adapter's
        (PEFT names) and replace it on every target in one phase. `staging` goes to a single
        target's update_weights_from_distributed ("standby" | "none"; None: the target's
        default); two phases always receive beside the live weights, so they refuse "none".

        delta=True sends only what changed since the version the targets last committed
        through this sender, in the targets' weights dtype (`DeltaTracker`: one copy of the
        weights in that dtype is kept here); a first push, targets on another version, or a
        delta any target refuses, is followed by a full push, by itself. `last_push` says what
        went on the wire."""
        extra = {k: v for k, v in {"lora_name": lora_name, "staging": staging}.items()
                 if v is not None}
        two_phase = len(targets) > 1 and lora_name is None
        if lora_name is not None and (weight_version is not None or staging is not None
                                      or flush_cache is not True or delta):
            raise ValueError("weight_version, staging, flush_cache=False, delta: not for an "
                             "adapter update (lora_name is set); the adapter is replaced at once, "
                             "under its own version")
        if two_phase and staging not in (None, "standby"):
            raise ValueError(f"staging={staging!r} with {len(targets)} targets: two-phase "
                             "updates receive beside the live weights so that all or none "
                             "commit; use 'standby' or None")
        check_load_format(load_format)
        tensors = _as_list(named_tensors)
        targets = list(targets)
        self._follow_membership(targets)
        self._check_targets(targets)
        if two_phase:
            _check_two_phase(targets)
        self.connect(targets, tensors[0][1].device)
        wire = self.wire_dtype if lora_name is None else None  # an adapter travels as it is
        push = _Push(targets, weight_version, flush_cache, pause_mode, two_phase, extra, wire)
        if delta:
            return self._send_delta(tensors, push, load_format)
        specs = _specs(tensors, wire)
        replies = self._push(tensors, _spec(specs, load_format, self.group_name), push)
        self.last_push = {"kind": "full", "bytes": sum(s.nbytes for s in specs)}
        return replies

    def _push(self, payload: Any, spec: dict[str, Any], push: _Push) -> list[dict]:
        """One update on every target: the RPCs, and the payload on the wire."""
        if push.two_phase:
            return self._send_two_phase(payload, push.targets, spec, push.weight_version,
                                        push.pause_mode, push.wire)
        calls = [_Call(t.update_weights_from_distributed, **spec,
                       weight_version=push.weight_version, flush_cache=push.flush_cache,
                       pause_mode=push.pause_mode, **push.extra) for t in push.targets]
        self._broadcast_to(calls, push.targets, payload, spec["load_format"], push.wire)
        failures = _failures(calls, push.targets, self.timeout_s)
        if failures:
            raise WeightSyncError(f"update {push.weight_version!r} failed on {failures}",
                                  failures)
        return [call.result for call in calls]

    def _send_delta(self, tensors: list[tuple[str, torch.Tensor]], push: _Push,
                    load_format: str | None) -> list[dict]:
        dtype = weights_dtype(push.targets)
        if self.delta is None or self.delta.dtype != dtype:
            self.delta = DeltaTracker(dtype)
        tracker = self.delta
        planned = tracker.plan(tensors, {str(t.get_weight_version()) for t in push.targets})
        if planned is not None:
            delta, rounded = planned
            try:
                replies = self._push(delta, _spec(delta.specs, "delta", self.group_name), push)
            except WeightSyncError as err:
                logger.warning("delta push refused (%s); pushing the full weights", err)
            else:
                tracker.committed(str(replies[0]["weight_version"]), rounded)
                self.last_push = delta_stats(delta)
                return replies
        tracker.forget()
        specs = _specs(tensors, push.wire)
        replies = self._push(tensors, _spec(specs, load_format, self.group_name), push)
        tracker.after_full(str(replies[0]["weight_version"]), tensors)
        self.last_push = {**full_stats(tracker, tensors), "bytes": sum(s.nbytes for s in specs)}
        return replies

    def _send_two_phase(self, tensors: Any, targets: list[Any],
                        spec: dict[str, Any], weight_version: str | None,
                        pause_mode: str, wire: torch.dtype | None) -> list[dict]:
        calls = [_Call(t.prepare_weights_from_distributed, **spec) for t in targets]
        try:
            self._broadcast_to(calls, targets, tensors, spec["load_format"], wire)
        except WeightSyncError:
            _abort_all(targets, self.timeout_s)
            raise
        failures = _failures(calls, targets, self.timeout_s)
        if failures:
            _abort_all(targets, self.timeout_s)
            raise WeightSyncError(f"update {weight_version!r} failed on {failures}; no target "
                                  "committed it", failures)
        version = weight_version or agreed_version([c.result for c in calls])
        commits = [_Call(t.commit_weight_update, weight_version=version, pause_mode=pause_mode)
                   for t in targets]
        failures = _failures(commits, targets, self.timeout_s)
        if failures:
            # Every target held the validated update; a commit fails only if a target died.
            raise WeightSyncError(f"commit of version {version!r} failed on {failures} after "
                                  "every target had prepared it; the others committed", failures)
        return [call.result for call in commits]

    def _broadcast_to(self, calls: list[_Call], targets: list[Any], tensors: Any,
                      load_format: str | None, wire: torch.dtype | None) -> None:
        assert self.group is not None
        try:
            self._broadcast(tensors, load_format, wire)
        except Exception as err:
            # The group is out of step now; drop every side so the next send starts afresh.
            self.group.destroy()
            failures = _failures(calls, targets, self.timeout_s)
            self._destroy_targets(targets)
            raise WeightSyncError(f"broadcast failed: {err}; targets: {failures}",
                                  failures) from err

    def close(self, targets: Sequence[Any]) -> None:
        """Destroys the group on every target and here."""
        self._flat = [None, None]
        self.wire_dtype = None
        if self.group is not None:
            self.group.destroy()
            self.group = None
        failures = self._destroy_targets(list(targets))
        if failures:
            raise WeightSyncError(f"destroying {self.group_name!r} failed on {failures}",
                                  failures)

    def _check_targets(self, targets: list[Any]) -> None:
        ranks = sum(_ranks_of(t) for t in targets)
        if 1 + ranks != self.world_size:
            raise ValueError(f"world_size {self.world_size} needs targets holding "
                             f"{self.world_size - 1} ranks, got {len(targets)} target(s) "
                             f"holding {ranks}")

    def _broadcast(self, tensors: Any, load_format: str | None,
                   wire: torch.dtype | None) -> None:
        assert self.group is not None
        device = self.group.device
        if load_format == "delta":
            tensors.broadcast(self.group)
            return
        with torch.no_grad():
            if load_format is None:
                for _, tensor in tensors:
                    self.group.broadcast(tensor.detach().to(
                        device, on_wire(tensor.dtype, wire)).contiguous())
                return
            by_name = dict(tensors)
            buckets = plan_buckets(_specs(tensors, wire), self.bucket_bytes)
            self.group.broadcast(bucket_header(buckets, len(tensors)).to(device))
            # Two buffers: bucket k+1 is flattened while bucket k is on the wire.
            pool = self._flat if device.type == "cpu" else [None, None]
            pending: list[Any] = [None, None]
            try:
                for i, bucket in enumerate(buckets):
                    slot = i % 2
                    self.group.wait(pending[slot])
                    pending[slot] = None
                    parts = [by_name[s.name].detach().to(device) for s in bucket.specs]
                    pending[slot] = self.group.broadcast_start(
                        flatten_into(pool, slot, bucket, parts, device))
            except BaseException:
                # Never drop a broadcast still in flight: its buffer and the group must outlive it.
                for work in pending:
                    with contextlib.suppress(Exception):
                        self.group.wait(work)
                raise
            for work in pending:
                self.group.wait(work)

    def _destroy_targets(self, targets: list[Any]) -> dict[str, str]:
        calls = [_Call(t.destroy_weights_update_group, group_name=self.group_name)
                 for t in targets]
        return _failures(calls, targets, self.timeout_s)


@dataclass(frozen=True)
class _Push:
    """One send's targets and options, whatever goes on the wire."""

    targets: list[Any]
    weight_version: str | None
    flush_cache: bool
    pause_mode: str
    two_phase: bool
    extra: dict[str, Any]
    wire: torch.dtype | None  # what wider float tensors are rounded to (on_wire)


def _specs(tensors: list[tuple[str, torch.Tensor]], wire: torch.dtype | None
           ) -> list[TensorSpec]:
    """The tensors as they travel."""
    return [TensorSpec(n, on_wire(x.dtype, wire), tuple(x.shape)) for n, x in tensors]


def _spec(specs: list[TensorSpec], load_format: str | None, group_name: str) -> dict[str, Any]:
    """The RPC's description of an update's tensors."""
    return dict(names=[s.name for s in specs], dtypes=[dtype_to_str(s.dtype) for s in specs],
                shapes=[list(s.shape) for s in specs], group_name=group_name,
                load_format=load_format)


def common_float_dtype(targets: Sequence[Any]) -> torch.dtype | None:
    """The float dtype every target reports keeping its weights in; None when one does not
    say (or cannot now) or they differ: the tensors then travel as they are."""
    try:
        dtype = weights_dtype(targets)
    except Exception:  # noqa: BLE001 - only a saving is lost: nothing is rounded
        return None
    return dtype if dtype.is_floating_point else None


def weights_dtype(targets: Sequence[Any]) -> torch.dtype:
    """The dtype every target keeps its weights in (`weights_dtype` of Engine and
    RemoteEngine): what a delta is computed and sent in."""
    found = {getattr(t, "weights_dtype", None) for t in targets}
    if None in found or len(found) != 1:
        raise ValueError(f"delta=True needs targets that report one weights_dtype (Engine, "
                         f"RemoteEngine); got {sorted(map(str, found))}")
    return str_to_dtype(found.pop())


def _as_list(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tensors = [(name, tensor) for name, tensor in items]
    if not tensors:
        raise ValueError("no tensors to send")
    if len({name for name, _ in tensors}) != len(tensors):
        raise ValueError("tensor names must be unique")
    for name, tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        dtype_to_str(tensor.dtype)
    return tensors


def _ranks_of(target: Any) -> int:
    return int(getattr(target, "weight_sync_ranks", 1))


def _membership(targets: list[Any]) -> tuple:
    """What a group made now would hold: a fleet names its replicas (weight_sync_members)."""
    return tuple(getattr(t, "weight_sync_members", None) for t in targets)


def _rank_offsets(targets: list[Any]) -> list[int]:
    offsets, next_rank = [], 1
    for target in targets:
        offsets.append(next_rank)
        next_rank += _ranks_of(target)
    return offsets


_TWO_PHASE = ("prepare_weights_from_distributed", "commit_weight_update", "abort_weight_update")


def _check_two_phase(targets: list[Any]) -> None:
    for i, target in enumerate(targets):
        missing = [m for m in _TWO_PHASE if not callable(getattr(target, m, None))]
        if missing:
            raise ValueError(f"target {i} ({target!r}) lacks {', '.join(missing)}: several "
                             "targets update in two phases so that all or none commit")


def agreed_version(replies: list[dict]) -> str:
    """One version for every target of an update sent with weight_version=None: the newest
    that any target proposed, in the one order of versions (versions.py)."""
    return newest(str(r.get("weight_version")) for r in replies)


def _abort_all(targets: list[Any], timeout_s: float) -> dict[str, str]:
    calls = [_Call(t.abort_weight_update) for t in targets]
    return _failures(calls, targets, timeout_s)


def _failures(calls: list[_Call], targets: list[Any], timeout_s: float) -> dict[str, str]:
    """{target i (repr): why} for each call that failed; waits timeout_s in all at most."""
    deadline = time.monotonic() + timeout_s
    failures = {}
    for i, (call, target) in enumerate(zip(calls, targets, strict=True)):
        why = call.failure(deadline)
        if why is not None:
            failures[f"target {i} ({target!r})"] = why
    return failures


def hf_module_order(model_path: str, names: Iterable[str]) -> list[str]:
    """`names` in the order an HF model's named_parameters() yields them, as a trainer sends."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    rank = {n: i for i, (n, _) in enumerate(model.named_parameters(remove_duplicate=False))}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))
