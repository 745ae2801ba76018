"""Coordinator: the control and weight calls of several engines as one EngineClient.

Every control call reaches every member. Weight updates end on one version or on none: one-call
updates prepare on every member and commit only when all prepared; staged updates (commit=False)
stage on every member, and the first member's commit picks the version the others commit. The
members an update or a weight group starts with are the ones it ends with, even if the set of
members changes meanwhile. `Router` (HTTP servers) and `RayFleet` (Ray actors) are
coordinators; each says what its members are and how it generates. docs/fleet.md says more.

Members may serve several models (a policy beside a frozen reward model or judge): an update
reaches the members of the model it names (`model=`), or with none the policy's
(`_update_members`); reads of the weights, groups, adapters and memory are the policy's; the
serving-state calls (pause, flush, abort, integrity) reach every member.
"""

from __future__ import annotations

import functools
import threading
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hotswap.engine.client.protocol import EngineClient, check_pause_mode, resolve_commit
from hotswap.engine.client.request import DistributedUpdate
from hotswap.weight_sync.sender import agreed_version

Member = tuple[str, Any]  # (label, an EngineClient)
Results = list[tuple[str, Any]]  # (label, the reply or the exception raised)


F = TypeVar("F", bound=Callable[..., Any])


def _one_update_at_a_time(method: F) -> F:
    @functools.wraps(method)
    def locked(self: Coordinator, *args: Any, **kwargs: Any) -> Any:
        with self._update_lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


class ServersDisagree(RuntimeError):
    """Members that should hold the same state (version, weights, adapters) do not."""


class Coordinator(EngineClient):
    def __init__(self) -> None:
        # Updates, staging, commits and aborts one at a time (a subclass copying weights
        # between its members takes it too).
        self._update_lock = threading.RLock()
        self._proposed: str | None = None
        self._staged_on: list[Member] | None = None  # an update staged or prepared, not committed
        self._groups: dict[str, list[Member]] = {}

    @abstractmethod
    def members(self) -> list[Member]:
        """The engines a call made now reaches, labelled for messages."""

    def _update_members(self, model: str | None) -> list[Member]:
        """The members an update addressed to `model` (None: the policy) reaches; ValueError
        when no member serves it. Members of one model by default."""
        return self.members()

    def _on_commit(self, version: str, members: list[Member]) -> str:
        """Called after `members` committed `version`; returns a note for the result's
        message (a subclass records the version, or names engines the update left out)."""
        return ""

    # serving state: every member

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self._combined(self.call_each(lambda e: e.abort_request(rid, abort_all)), "abort")

    def pause_generation(self, mode: str = "retract") -> dict:
        return self._combined(self.call_each(lambda e: e.pause_generation(mode)), "paused")

    def continue_generation(self) -> dict:
        return self._combined(self.call_each(lambda e: e.continue_generation()), "continued")

    def flush_cache(self, timeout_s: float | None = None) -> dict:
        return self._combined(self.call_each(lambda e: e.flush_cache(timeout_s)), "flushed")

    # A frozen model keeps its memory: released weights come back only with an update.

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._combined(self.call_each(lambda e: e.release_memory_occupation(tags),
                                             self._update_members(None)), "released")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._combined(self.call_each(lambda e: e.resume_memory_occupation(tags),
                                             self._update_members(None)), "resumed")

    def check_integrity(self) -> None:
        failed = failures(self.call_each(lambda e: e.check_integrity()))
        if failed:
            raise AssertionError(f"integrity check failed on {failed}")

    # weights: reads that every member of the policy must answer alike

    def get_weight_version(self) -> str:
        return self._same(self._policy_call(lambda e: e.get_weight_version()), "weight version")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self._same(self._policy_call(lambda e: e.get_weights_by_name(
            name, truncate_size)), f"values of {name!r}")

    def list_lora_adapters(self) -> dict[str, int]:
        return self._same(self._policy_call(lambda e: e.list_lora_adapters()), "LoRA adapters")

    def _policy_call(self, fn: Callable[[Any], Any]) -> Results:
        return self.call_each(fn, self._update_members(None))

    @_one_update_at_a_time
    def update_weight_version(self, new_version: str, abort_all_requests: bool = False, *,
                              model: str | None = None) -> dict:
        members = self._update_members(model)
        result = self._combined(self.call_each(
            lambda e: e.update_weight_version(new_version, abort_all_requests, model=model),
            members), f"relabelled {new_version!r}")
        if result["success"]:
            self._on_commit(new_version, members)
        return result

    # weights: updates, on every member or on none

    def update_weights_from_serialized(self, serialized_named_tensors: list[str],
                                       load_format: str | None = None, flush_cache: bool = True,
                                       *, weight_version: str | None = None,
                                       pause_mode: str = "retract",
                                       commit: bool | None = None,
                                       model: str | None = None) -> dict:
        return self._staged(lambda e: e.update_weights_from_serialized(
            serialized_named_tensors, load_format, flush_cache, weight_version=weight_version,
            pause_mode=pause_mode, commit=False, model=model),
            resolve_commit(commit, flush_cache), weight_version, self._update_members(model))

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None, *,
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 pause_mode: str = "retract", commit: bool | None = None,
                                 model: str | None = None) -> dict:
        commit = resolve_commit(commit, flush_cache)
        members = self._update_members(model)
        if not commit or self._pieces_open():
            return self._staged(lambda e: e.update_weights_from_disk(
                model_path, load_format, weight_version=weight_version, pause_mode=pause_mode,
                commit=False, model=model), commit, weight_version, members)
        if load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {load_format!r}: checkpoints load as safetensors")
        return self._two_phase(lambda e: e.prepare_weights_from_disk(model_path, model=model),
                               members, weight_version, pause_mode)

    @_one_update_at_a_time
    def commit_weight_update(self, weight_version: str | None = None,
                             pause_mode: str | None = None) -> dict:
        """The open update on every member as one version: a prepared one at the version they
        all proposed (or the one given); pieces (commit=False) at the version the first member
        picks (it knows its own history), the others following."""
        members = self._staged_on or self._update_members(None)
        if self._proposed is not None:
            version = weight_version or self._proposed
            return self._committed(self.call_each(
                lambda e: e.commit_weight_update(version, pause_mode), members), version,
                members)
        label, first_engine = members[0]
        first = first_engine.commit_weight_update(weight_version, pause_mode)
        if not first.get("success"):
            self.abort_weight_update()
            return {**first, "message": f"{label}: {first.get('message')}; every member "
                    "aborted its open update"}
        version = first["weight_version"]
        rest = self.call_each_indexed(lambda i, e: first if i == 0 else
                                      e.commit_weight_update(version), members)
        return self._committed(rest, version, members)

    def _pieces_open(self) -> bool:
        """Whether members hold pieces sent with commit=False: a committing update then joins
        them (as on an Engine) instead of preparing beside them."""
        return self._staged_on is not None and self._proposed is None

    @_one_update_at_a_time
    def abort_weight_update(self) -> dict:
        members = self._staged_on or self._update_members(None)
        self._staged_on, self._proposed = None, None
        return self._combined(self.call_each(lambda e: e.abort_weight_update(), members),
                              "aborted")

    # weights: a trainer's process group

    @property
    def weights_dtype(self) -> str:
        """The dtype the policy's members keep their weights in (what a delta carries)."""
        return self._same(self._policy_call(lambda e: e.weights_dtype), "weights' dtype")

    @property
    def weight_sync_ranks(self) -> int:
        """Ranks a group made now takes: every policy member's (its TP size)."""
        return sum(e.weight_sync_ranks for _, e in self._update_members(None))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "auto") -> dict:
        """Member i joins at rank_offset + the ranks of the members before it (one each
        unless a member runs tensor parallel). The group keeps these members: the policy's
        (a frozen model is never in a trainer's group)."""
        members = self._update_members(None)
        ranks = [e.weight_sync_ranks for _, e in members]
        if rank_offset + sum(ranks) > world_size:
            raise ValueError(f"world_size {world_size} has no room for {sum(ranks)} ranks from "
                             f"rank {rank_offset}")
        offsets = [rank_offset + sum(ranks[:i]) for i in range(len(members))]
        results = self.call_each_indexed(lambda i, e: e.init_weights_update_group(
            master_address, master_port, offsets[i], world_size, group_name, backend), members)
        result = self._combined(results, f"joined {group_name!r}")
        if result["success"]:
            self._groups[group_name] = members
        return result

    def _group_members(self, group_name: str) -> list[Member]:
        """The members that joined `group_name` (the policy's if none joined through here)."""
        return self._groups.get(group_name) or self._update_members(None)

    def _update_weights_from_distributed(self, update: DistributedUpdate) -> dict:
        """Every member of the group receives the one broadcast at once. Several engines
        always stage (staging="none" could not be all-or-none)."""
        u = update
        if u.staging not in (None, "standby"):
            raise ValueError(f"staging={u.staging!r}: several engines update all-or-none, so "
                             "they receive into standby buffers; use staging='standby'")
        members = self._group_members(u.group_name)
        if u.lora_name is not None:
            return self._combined(self.call_each(
                lambda e: e.update_weights_from_distributed(**u.body()), members),
                f"updated adapter {u.lora_name!r}")
        commit = resolve_commit(u.commit, u.flush_cache)
        if not commit or self._pieces_open():
            staged = u.replace(commit=False).body()
            return self._staged(lambda e: e.update_weights_from_distributed(**staged), commit,
                                u.weight_version, members)
        return self._two_phase(lambda e: e.prepare_weights_from_distributed(
            **u.prepare_body()), members, u.weight_version, u.pause_mode)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        members = self._groups.pop(group_name, None) or self._update_members(None)
        results = self.call_each(lambda e: e.destroy_weights_update_group(group_name), members)
        return self._combined(results, f"destroyed {group_name!r}")

    # weights: two phases (prepare, then commit_weight_update), the coordinator itself a
    # participant of a larger one

    def _prepare_weights_from_distributed(self, update: DistributedUpdate) -> dict:
        return self._prepare(lambda e: e.prepare_weights_from_distributed(
            **update.prepare_body()), self._group_members(update.group_name))

    def prepare_weights_from_disk(self, model_path: str, *, model: str | None = None) -> dict:
        return self._prepare(lambda e: e.prepare_weights_from_disk(model_path, model=model),
                             self._update_members(model))

    # LoRA adapters: the same adapters on every member of the policy

    def load_lora_adapter(self, lora_name: str, lora_path: str, *,
                          pause_mode: str = "retract") -> dict:
        return self._combined(self._policy_call(lambda e: e.load_lora_adapter(
            lora_name, lora_path, pause_mode=pause_mode)), f"loaded {lora_name!r}")

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict,
                                       *, pause_mode: str = "retract") -> dict:
        return self._combined(self._policy_call(lambda e: e.load_lora_adapter_from_tensors(
            lora_name, tensors, config_dict, pause_mode=pause_mode)), f"loaded {lora_name!r}")

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._combined(self._policy_call(lambda e: e.unload_lora_adapter(lora_name)),
                              f"unloaded {lora_name!r}")

    # all or none

    @_one_update_at_a_time
    def _prepare(self, prepare: Callable[[Any], dict], members: list[Member]) -> dict:
        results = self.call_each(prepare, members)
        failed = failures(results)
        if failed:
            self.call_each(lambda e: e.abort_weight_update(), members)
            message = f"update refused by {failed}; no member committed it"
            raise_bad_input(results, message)
            return {"success": False, "message": message, "weight_version": None}
        self._proposed = agreed_version([r for _, r in results])
        self._staged_on = members
        return {"success": True, "message": f"prepared on {len(members)} members",
                "weight_version": self._proposed}

    @_one_update_at_a_time
    def _two_phase(self, prepare: Callable[[Any], dict], members: list[Member],
                   weight_version: str | None, pause_mode: str) -> dict:
        if weight_version is not None and (not isinstance(weight_version, str)
                                           or not weight_version):
            raise ValueError("weight_version must be a non-empty string")
        check_pause_mode(pause_mode)  # before anything is prepared, not at the commit
        prepared = self._prepare(prepare, members)
        if not prepared["success"]:
            return prepared
        return self.commit_weight_update(weight_version, pause_mode)

    @_one_update_at_a_time
    def _staged(self, stage: Callable[[Any], dict], commit: bool, weight_version: str | None,
               members: list[Member] | None = None) -> dict:
        """stage(member) on every member (an update with commit=False); commits them all
        when `commit`, or aborts them all if any refused."""
        members = self._staged_on or members or self.members()
        results = self.call_each(stage, members)
        failed = failures(results)
        if failed:
            self.abort_weight_update()
            message = f"update refused by {failed}; no member committed it"
            raise_bad_input(results, message)
            return {"success": False, "weight_version": None, "message": message}
        self._staged_on = members
        if commit:
            return self.commit_weight_update(weight_version)
        return {**results[0][1], "message": f"staged on {len(members)} members"}

    def _committed(self, results: Results, version: str | None,
                   members: list[Member]) -> dict:
        self._staged_on, self._proposed = None, None
        failed = failures(results)
        if failed:
            # Every member held the validated update; a commit fails only if a member died.
            return {"success": False, "weight_version": version, "message":
                    f"commit of {version!r} failed on {failed}; the other members committed"}
        note = self._on_commit(str(version), members)
        return {"success": True, "weight_version": version,
                "message": f"{len(members)} members updated to version {version!r}{note}"}

    # fan-out

    def call_each(self, fn: Callable[[Any], Any],
                  members: list[Member] | None = None) -> Results:
        return self.call_each_indexed(lambda _, e: fn(e), members)

    def call_each_indexed(self, fn: Callable[[int, Any], Any],
                          members: list[Member] | None = None) -> Results:
        """fn on every member at once (a group rendezvous needs them all): each member's
        label with its reply or the exception it raised."""
        members = self.members() if members is None else members

        def call(i: int) -> Any:
            try:
                return fn(i, members[i][1])
            except Exception as exc:  # noqa: BLE001 - returned for the caller to report
                return exc

        with ThreadPoolExecutor(max_workers=max(1, len(members))) as pool:
            replies = list(pool.map(call, range(len(members))))
        return [(label, reply) for (label, _), reply in zip(members, replies, strict=True)]

    def _combined(self, results: Results, what: str) -> dict:
        failed = failures(results)
        if failed:
            raise_bad_input(results, f"refused by {failed}")
            return {"success": False, "message": f"failed on {failed}"}
        return {"success": True, "message": f"{what} on {len(results)} members"}

    @staticmethod
    def _same(results: Results, what: str) -> Any:
        failed = failures(results)
        if failed:
            raise_bad_input(results, f"refused by {failed}")
            raise ServersDisagree(f"could not read the {what} of every member: {failed}")
        replies = [r for _, r in results]
        if any(r != replies[0] for r in replies):
            raise ServersDisagree(f"members disagree on the {what}: {dict(results)}")
        return replies[0]


def failures(results: Results) -> dict[str, str]:
    """{label: why} for each member whose call raised or answered success=False."""
    failed = {}
    for label, result in results:
        if isinstance(result, BaseException):
            failed[label] = f"{type(result).__name__}: {result}"
        elif isinstance(result, dict) and not result.get("success", True):
            failed[label] = str(result.get("message"))
    return failed


def raise_bad_input(results: Results, message: str) -> None:
    """Bad input is refused alike by every member: raised as the engine raises it."""
    errors = [r for _, r in results if isinstance(r, BaseException)]
    for kind in (ValueError, PermissionError):
        if errors and all(isinstance(e, kind) for e in errors):
            raise kind(message)
