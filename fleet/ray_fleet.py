"""RayFleet: engine replicas as Ray actors, one EngineClient (docs/fleet.md#ray-fleet).

Each replica is an `EngineReplica` actor in one bundle of a placement group (the fleet's own,
packed or spread over nodes, or the caller's). A replica goes starting -> joining -> serving:
it takes requests and updates only once it holds the fleet's weight version, copied from a
serving replica through the object store. A health check finds dead replicas within about
two periods; their requests are sampled again on live replicas and a new actor takes the
same bundle. Control calls and updates are the Coordinator's (all serving replicas, all or
none); the members an update starts with are the ones it ends with, and a replica still
joining is left out and catches up after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hotswap.engine.client.protocol import per_prompt, resolve_commit
from hotswap.fleet.affinity import PrefixAffinity, affinity_key
from hotswap.fleet.coordinator import Coordinator, Member
from hotswap.fleet.replica import FORWARDED, EngineReplica, pack_tensors

logger = logging.getLogger("hotswap.fleet")

PLACEMENTS = {"pack": "PACK", "spread": "STRICT_SPREAD"}
_RESUBMITS = 3  # a request is sampled again at most this many times


class ReplicaGone(RuntimeError):
    """No live replica could take a request (every one died, or the fleet shut down)."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as err:  # pragma: no cover - the extra is missing
        raise ImportError("RayFleet needs Ray: pip install 'hotswap[ray]'") from err
    return ray


def _died(exc: BaseException) -> bool:
    ray = _ray()
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                            ray.exceptions.ActorUnavailableError))


def _unwrap(exc: BaseException) -> BaseException:
    """The engine's own exception out of Ray's wrapper (ValueError stays ValueError)."""
    cause = getattr(exc, "cause", None)
    ray = _ray()
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, Exception):
        return cause
    return exc


class ReplicaClient:
    """An EngineReplica actor called like an Engine: blocking calls, the engine's errors."""

    def __init__(self, actor: Any, ranks: int, label: str):
        self.actor, self.weight_sync_ranks, self.label = actor, ranks, label

    def __repr__(self) -> str:
        return self.label

    def __getattr__(self, name: str) -> Any:
        if name not in FORWARDED:
            raise AttributeError(name)
        return lambda *args, **kwargs: self.get(self.actor.call.remote(name, *args, **kwargs))

    def prepare_tensors(self, packed: Any) -> dict:
        return self.get(self.actor.prepare_tensors.remote(packed))

    def update_tensors(self, packed: Any, *args: Any, **kwargs: Any) -> dict:
        return self.get(self.actor.update_tensors.remote(packed, *args, **kwargs))

    @staticmethod
    def get(ref: Any, timeout: float | None = None) -> Any:
        try:
            return _ray().get(ref, timeout=timeout)
        except Exception as exc:
            raise _unwrap(exc) from None


@dataclass(eq=False)
class _Replica:
    index: int  # never reused: messages and the affinity tree name replicas by it
    slot: int
    actor: Any = None
    client: ReplicaClient | None = None
    state: str = "starting"  # starting | joining | serving | draining | dead
    info: dict = field(default_factory=dict)
    inflight: int = 0  # samples sent and not returned
    requests: int = 0
    tokens: int = 0
    misses: int = 0  # health checks in a row without an answer


@dataclass
class _Row:
    kind: str  # "prompt" | "input_ids" | "messages"
    value: Any
    params: dict
    lora: str | None
    salt: str | None
    rid: str

    @property
    def samples(self) -> int:
        n = self.params.get("n", 1)
        return n if isinstance(n, int) and n > 0 else 1

    def sample_ids(self) -> list[str]:
        return [self.rid] if self.samples == 1 else [f"{self.rid}-{k}" for k in
                                                     range(self.samples)]


def _rows(prompt: Any, input_ids: Any, messages: Any, sampling_params: Any, lora_name: Any,
          cache_salt: Any, rid: Any) -> tuple[list[_Row], bool]:
    """The batch as rows, split as the Engine splits it (the replica validates the rest)."""
    given = [(k, v) for k, v in (("prompt", prompt), ("input_ids", input_ids),
                                 ("messages", messages)) if v is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of prompt, input_ids, messages")
    kind, value = given[0]
    single = (isinstance(value, str) or (kind == "input_ids" and bool(value) and all(
        isinstance(t, int) for t in value)) or (kind == "messages" and bool(value) and all(
            isinstance(m, dict) for m in value)))
    values = [value] if single else value
    if not isinstance(values, list) or not values:
        raise ValueError(f"{kind} must be non-empty")
    count = len(values)
    params = per_prompt(sampling_params, count, "sampling_params", dict)
    loras = per_prompt(lora_name, count, "lora_name", str)
    salts = per_prompt(cache_salt, count, "cache_salt", str)
    rids = per_prompt(rid, count, "rid", str)
    if len(set(r for r in rids if r is not None)) < sum(r is not None for r in rids):
        raise ValueError("rid values must be unique")
    rows = [_Row(kind, v, p or {}, lo, s, r or uuid.uuid4().hex)
            for v, p, lo, s, r in zip(values, params, loras, salts, rids, strict=True)]
    return rows, single


def _call_kwargs(rows: list[_Row], options: dict[str, Any]) -> dict:
    """A replica's generate arguments for `rows`; `options` are the call's per-call flags."""
    return {rows[0].kind: [r.value for r in rows], "sampling_params": [r.params for r in rows],
            "lora_name": [r.lora for r in rows], "cache_salt": [r.salt for r in rows],
            "rid": [r.rid for r in rows], **options}


class RayFleet(Coordinator):
    def __init__(self, model_path: str, replicas: int = 1, tp_size: int = 1,
                 engine_kwargs: dict | None = None,
                 resources_per_replica: dict[str, float] | None = None,
                 placement: str = "pack", placement_group: Any = None, *,
                 http: bool = False, health_period_s: float = 1.0,
                 start_timeout_s: float = 600.0, cache_threshold: float = 0.5,
                 max_concurrency: int = 256):
        """replicas Engine(model_path, tp_size=tp_size, **engine_kwargs) actors, each in one
        bundle of `resources_per_replica` ({"CPU": 1} by default; {"GPU": tp_size} on GPUs).
        placement "pack" or "spread" (one replica per node) applies to the fleet's own
        placement group; with `placement_group` replica i takes its bundle i. `http`: each
        replica also serves the engine's HTTP API (its URL in replicas_info)."""
        super().__init__()
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {sorted(PLACEMENTS)}, got {placement!r}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        ray = _ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(include_dashboard=False, configure_logging=False)
        self.model_path = model_path
        self.engine_kwargs = {**(engine_kwargs or {}), "tp_size": tp_size}
        self.resources = dict(resources_per_replica or {"CPU": 1})
        self.placement = placement
        self.http = http
        self.health_period_s = health_period_s
        self.start_timeout_s = start_timeout_s
        self.cache_threshold = cache_threshold
        self.max_concurrency = max_concurrency
        self.affinity = PrefixAffinity()
        self._lock = threading.RLock()  # replicas, their states and counters
        self._indices = itertools.count()
        self._replicas: list[_Replica] = []
        self._own_groups: list[Any] = []
        self._slots: list[tuple[Any, int]] = []  # (placement group, bundle index)
        self._free_slots: list[int] = []
        self._adapters: dict[str, tuple[str, tuple, dict]] = {}  # replayed on joiners
        self._stopped = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency,
                                        thread_name_prefix="fleet-call")
        if placement_group is not None:
            self._slots = [(placement_group, i) for i in range(placement_group.bundle_count)]
            self._free_slots = list(range(len(self._slots)))
        self.version = ""
        try:
            self._reserve(replicas)
            started = [self._start(self._take_slot()) for _ in range(replicas)]
            for replica in started:
                self._await_started(replica)
            versions = {r.info["weight_version"] for r in started}
            if len(versions) != 1:
                raise RuntimeError(f"fresh replicas disagree on their version: {versions}")
            self.version = versions.pop()
            for replica in started:
                replica.state = "serving"
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._watch, name="fleet-health", daemon=True)
        self._monitor.start()

    def __repr__(self) -> str:
        return f"RayFleet({self.model_path!r}, replicas={len(self._serving())})"

    # placement

    def _reserve(self, count: int) -> None:
        """Makes sure `count` bundles are free: the caller's group must have them; the fleet
        makes one more placement group of its own for what is missing (so "spread" holds
        among the replicas of one call, and best effort beyond)."""
        missing = count - len(self._free_slots)
        if missing <= 0:
            return
        if self._slots and not self._own_groups:
            raise ValueError(f"the caller's placement group has {len(self._slots)} bundles, "
                             f"{len(self._free_slots)} free, for {count} more replicas")
        self._grow_slots(missing)

    def _take_slot(self) -> int:
        with self._lock:
            return self._free_slots.pop(0)

    def _grow_slots(self, count: int) -> None:
        """Adds `count` bundles in a new placement group of the fleet's own."""
        ray = _ray()
        group = ray.util.placement_group([dict(self.resources)] * count,
                                         strategy=PLACEMENTS[self.placement])
        ready, _ = ray.wait([group.ready()], timeout=self.start_timeout_s)
        if not ready:
            ray.util.remove_placement_group(group)
            raise RuntimeError(f"Ray could not place {count} bundle(s) of {self.resources} "
                               f"with placement {self.placement!r} within "
                               f"{self.start_timeout_s} s (not enough nodes or resources)")
        self._own_groups.append(group)
        first = len(self._slots)
        self._slots += [(group, i) for i in range(count)]
        self._free_slots += list(range(first, first + count))

    def _start(self, slot: int) -> _Replica:
        """A new actor in `slot`; its model loads in the background."""
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, bundle = self._slots[slot]
        extra = {k: v for k, v in self.resources.items() if k not in ("CPU", "GPU")}
        actor_class = ray.remote(EngineReplica).options(
            num_cpus=self.resources.get("CPU", 0), num_gpus=self.resources.get("GPU", 0),
            resources=extra or None, max_concurrency=self.max_concurrency, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=True))
        replica = _Replica(next(self._indices), slot)
        # Each replica its own sampling seed: requests that differ never share random streams.
        kwargs = {**self.engine_kwargs, "seed": self.engine_kwargs.get("seed", 0) + replica.index}
        replica.actor = actor_class.remote(self.model_path, kwargs, 0 if self.http else None)
        with self._lock:
            self._replicas.append(replica)
        return replica

    def _await_started(self, replica: _Replica) -> None:
        info = ReplicaClient.get(replica.actor.info.remote(), timeout=self.start_timeout_s)
        replica.info = info
        replica.client = ReplicaClient(replica.actor, info["weight_sync_ranks"],
                                       f"replica {replica.index}")
        replica.state = "joining"

    # members and states

    def _serving(self) -> list[_Replica]:
        with self._lock:
            return [r for r in self._replicas if r.state == "serving"]

    def members(self) -> list[Member]:
        return [(r.client.label, r.client) for r in self._serving()]

    @property
    def weight_sync_members(self) -> tuple[int, ...]:
        """The replicas a weight group made now would hold; a WeightSender re-forms its group
        when this changes (a replica died, joined or left)."""
        return tuple(r.index for r in self._serving())

    def replicas_info(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"index": r.index, "state": r.state, "pid": r.info.get("pid"),
                     "node_id": r.info.get("node_id"), "url": r.info.get("url"),
                     "weight_version": r.info.get("weight_version"),
                     "running": r.info.get("running", 0), "waiting": r.info.get("waiting", 0),
                     "requests": r.requests, "tokens": r.tokens} for r in self._replicas]

    def _on_commit(self, version: str, members: list[Member]) -> str:
        """Serving replicas outside the update (they joined meanwhile) go back to joining
        and copy the new weights before they serve again."""
        clients = {id(c) for _, c in members}
        with self._lock:
            self.version = version
            for r in self._replicas:
                if r.state == "serving" and id(r.client) in clients:
                    r.info["weight_version"] = version
            stale = [r for r in self._replicas if r.state in ("serving", "joining", "starting")
                     and id(r.client) not in clients]
            for r in stale:
                if r.state == "serving":
                    r.state = "joining"
                    self._pool.submit(self._catch_up, r)
        if not stale:
            return ""
        return (f"; left out {', '.join(f'replica {r.index} ({r.state})' for r in stale)}: it "
                "copies these weights before it serves")

    # health, replacement and catching up

    def _watch(self) -> None:
        while not self._stopped.wait(self.health_period_s):
            with self._lock:
                live = [r for r in self._replicas
                        if r.state in ("joining", "serving", "draining") and r.client]
            refs = {r.actor.info.remote(): r for r in live}
            if not refs:
                continue
            ready, late = _ray().wait(list(refs), num_returns=len(refs),
                                      timeout=max(2.0, 2 * self.health_period_s))
            for ref in ready:
                replica = refs[ref]
                try:
                    replica.info.update(ReplicaClient.get(ref))
                    replica.misses = 0
                except Exception as exc:  # noqa: BLE001 - any failure of a health check
                    if _died(exc):
                        self._lost(replica, f"{type(exc).__name__}")
            for ref in late:
                replica = refs[ref]
                replica.misses += 1
                if replica.misses >= 5:
                    _ray().kill(replica.actor, no_restart=True)
                    self._lost(replica, "no answer to 5 health checks")

    def _lost(self, replica: _Replica, why: str) -> None:
        """A replica died: it serves nothing more and a new actor takes its bundle."""
        with self._lock:
            if replica.state == "dead" or self._stopped.is_set():
                return
            draining = replica.state == "draining"
            replica.state = "dead"
            self.affinity.forget_server(replica.index)
        logger.warning("replica %d died (%s)", replica.index, why)
        if draining:
            self._free_slot(replica)
        else:
            self._pool.submit(self._replace, replica)

    def _replace(self, dead: _Replica) -> None:
        """A new actor in the dead one's bundle (retried until it starts: Ray may first have
        to move the bundle to a live node); it serves once it caught up."""
        while not self._stopped.is_set():
            replica = self._start(dead.slot)
            try:
                self._await_started(replica)
            except Exception:  # noqa: BLE001 - logged and retried
                logger.exception("replacing replica %d failed; retrying", dead.index)
                with self._lock:
                    self._replicas.remove(replica)
                with contextlib.suppress(Exception):
                    _ray().kill(replica.actor, no_restart=True)
                time.sleep(1.0)
                continue
            with self._lock:
                if dead in self._replicas:
                    self._replicas.remove(dead)
            self._catch_up(replica)
            return

    def _catch_up(self, replica: _Replica) -> None:
        """Copies the fleet's weights (and adapters) from a serving replica, then serves."""
        while not self._stopped.is_set() and replica.state == "joining":
            with self._update_lock:
                if self._staged_on is None:
                    try:
                        if self._copy_weights(replica):
                            with self._lock:
                                if replica.state == "joining":
                                    replica.state = "serving"
                            logger.info("replica %d serves version %r", replica.index,
                                        self.version)
                            return
                    except Exception as exc:  # noqa: BLE001 - retried, or the replica died
                        if _died(exc):
                            self._lost(replica, type(exc).__name__)
                            return
                        logger.warning("replica %d could not catch up: %s", replica.index, exc)
            time.sleep(0.2)

    def _copy_weights(self, replica: _Replica) -> bool:
        assert replica.client is not None
        if replica.client.get_weight_version() != self.version:
            sources = [r for r in self._serving() if r is not replica]
            if not sources:
                return False
            weights = sources[0].actor.weights_for_transfer.remote()
            replica.client.update_tensors(weights, weight_version=self.version)
        loaded = replica.client.list_lora_adapters()
        for name, (method, args, kwargs) in self._adapters.items():
            if loaded.get(name) is None:
                getattr(replica.client, method)(*args, **kwargs)
        replica.info["weight_version"] = replica.client.get_weight_version()
        return replica.info["weight_version"] == self.version

    # size

    def scale(self, replicas: int, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Grows or shrinks to `replicas` serving replicas between steps. New replicas take
        requests once they hold the fleet's weights; removed ones finish their requests
        first. Returns replicas_info()."""
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        with self._lock:
            live = [r for r in self._replicas if r.state in ("starting", "joining", "serving")]
        if replicas > len(live):
            self._reserve(replicas - len(live))
            added = [self._start(self._take_slot()) for _ in range(replicas - len(live))]
            for replica in added:
                self._await_started(replica)
                self._pool.submit(self._catch_up, replica)
            self._wait(lambda: all(r.state != "joining" for r in added), deadline, "join")
        else:
            ordered = sorted(live, key=lambda r: (r.state == "serving", -r.index))
            for replica in ordered[:len(live) - replicas]:
                self._drain(replica, deadline)
        return self.replicas_info()

    def _drain(self, replica: _Replica, deadline: float) -> None:
        with self._lock:
            replica.state = "draining"
            self.affinity.forget_server(replica.index)
        self._wait(lambda: replica.inflight == 0, deadline, "drain")
        if replica.client is not None:
            try:
                ReplicaClient.get(replica.actor.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - it is being removed anyway
                logger.debug("replica %d: shutdown failed", replica.index, exc_info=True)
        _ray().kill(replica.actor, no_restart=True)
        self._free_slot(replica)

    def _free_slot(self, replica: _Replica) -> None:
        with self._lock:
            replica.state = "dead"
            if replica in self._replicas:
                self._replicas.remove(replica)
            self._free_slots.append(replica.slot)

    def _wait(self, done: Any, deadline: float, what: str) -> None:
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas did not {what} in time: {self.replicas_info()}")
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Stops every replica, removes the fleet's placement groups, and stops Ray if the
        fleet started it."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        ray = _ray()
        with self._lock:
            actors = [r.actor for r in self._replicas if r.actor is not None]
            for r in self._replicas:
                r.state = "dead"
        for ref in [a.shutdown.remote() for a in actors]:
            with contextlib.suppress(Exception):  # dead or stuck: killed below
                ray.get(ref, timeout=30)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        for group in self._own_groups:
            ray.util.remove_placement_group(group)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_ray:
            ray.shutdown()

    # generation

    def _choose(self, row: _Row, exclude: set[int]) -> _Replica:
        """Prefix affinity if a replica holds most of the prompt and is not much busier,
        else the least loaded; waits for a serving replica while none is."""
        key = affinity_key("/generate", {row.kind: row.value})
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            with self._lock:
                serving = [r for r in self._replicas
                           if r.state == "serving" and r.index not in exclude]
                serving = serving or [r for r in self._replicas if r.state == "serving"]
                if serving:
                    chosen = self._by_affinity(key, serving) or min(
                        serving, key=lambda r: (r.inflight, r.requests, r.index))
                    chosen.inflight += row.samples
                    chosen.requests += row.samples
                    if key:
                        self.affinity.insert(key, chosen.index)
                    return chosen
            if self._stopped.is_set() or time.monotonic() > deadline:
                raise ReplicaGone("no serving replica to take the request")
            time.sleep(0.05)

    def _by_affinity(self, key: Any, serving: list[_Replica]) -> _Replica | None:
        if not key:
            return None
        matches = self.affinity.match(key)
        candidates = [r for r in serving if matches.get(r.index, 0) / len(key)
                      >= self.cache_threshold]
        if not candidates:
            return None
        best = max(candidates, key=lambda r: (matches[r.index], -r.inflight))
        idlest = min(r.inflight for r in serving)
        return best if best.inflight <= 2 * idlest + 16 else None

    def _assign(self, rows: list[_Row], exclude: set[int] = frozenset()
                ) -> dict[int, tuple[_Replica, list[int]]]:
        """Row positions per replica: rows with the same prompt go together."""
        by_prompt: dict[tuple, _Replica] = {}
        plan: dict[int, tuple[_Replica, list[int]]] = {}
        for i, row in enumerate(rows):
            same = (row.kind, repr(row.value), row.lora, row.salt)
            replica = by_prompt.get(same)
            if replica is None:
                replica = by_prompt[same] = self._choose(row, set(exclude))
            else:
                with self._lock:
                    replica.inflight += row.samples
                    replica.requests += row.samples
            plan.setdefault(replica.index, (replica, []))[1].append(i)
        return plan

    def _settle(self, replica: _Replica, rows: list[_Row], outs: list[dict] | None) -> None:
        with self._lock:
            replica.inflight -= sum(r.samples for r in rows)
            replica.tokens += sum(o["meta_info"].get("completion_tokens", 0)
                                  for o in outs or [])

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, *,
                 messages: list | None = None, return_logprob: bool = False,
                 top_logprobs_num: int = 0, lora_name: str | list[str | None] | None = None,
                 cache_salt: str | list[str | None] | None = None,
                 rid: str | list[str | None] | None = None,
                 stream: bool = False, return_routed_experts: bool = False
                 ) -> dict | list[dict] | Iterator[dict]:
        """Rows with the same prompt (and all samples of a row) go to one replica; outputs
        come back in the order given. A replica that dies takes no request with it: its rows
        are sampled again from the prompt on a live replica (meta_info "resubmitted")."""
        rows, single = _rows(prompt, input_ids, messages, sampling_params, lora_name,
                             cache_salt, rid)
        options = {"return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
                   "return_routed_experts": return_routed_experts}
        if stream:
            return self._stream(rows, options)
        outs = self._run(rows, options)
        return outs[0] if single and len(outs) == 1 else outs

    def _run(self, rows: list[_Row], options: dict[str, Any]) -> list[dict]:
        ray = _ray()
        results: dict[int, list[dict]] = {}
        pending: dict[Any, tuple[_Replica, list[int], int]] = {}
        failure: BaseException | None = None

        def submit(positions: list[int], tries: int, exclude: set[int]) -> None:
            for replica, part in self._assign([rows[i] for i in positions], exclude).values():
                chosen = [positions[j] for j in part]
                ref = replica.actor.generate.remote(_call_kwargs([rows[i] for i in chosen],
                                                                 options))
                pending[ref] = (replica, chosen, tries)

        submit(list(range(len(rows))), 0, set())
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            replica, positions, tries = pending.pop(ready[0])
            try:
                outs = ReplicaClient.get(ready[0])
            except Exception as exc:  # noqa: BLE001 - resubmitted, or raised below
                self._settle(replica, [rows[i] for i in positions], None)
                if _died(exc) and tries < _RESUBMITS and failure is None:
                    self._lost(replica, type(exc).__name__)
                    submit(positions, tries + 1, {replica.index})
                    continue
                failure = failure or exc
                self._abort_rows([rows[i] for _, ps, _ in pending.values() for i in ps])
                continue
            self._settle(replica, [rows[i] for i in positions], outs)
            it = iter(outs)
            for i in positions:
                results[i] = [next(it) for _ in range(rows[i].samples)]
                if tries:
                    for out in results[i]:
                        out["meta_info"]["resubmitted"] = tries
        if failure is not None:
            raise failure
        return [out for i in range(len(rows)) for out in results[i]]

    def _abort_rows(self, rows: list[_Row]) -> None:
        for row in rows:
            for sample in row.sample_ids():
                self.abort_request(sample)

    def _stream(self, rows: list[_Row], options: dict[str, Any]) -> Iterator[dict]:
        """Every replica's events, merged as they come. A sample whose replica died starts
        again from its prompt; its next event carries meta_info "restarted": True (drop what
        it had streamed)."""
        events: queue.Queue[tuple[str, Any]] = queue.Queue()
        closed = threading.Event()

        def pump(replica: _Replica, part: list[_Row], tries: int) -> None:
            ray = _ray()
            finished: set[str] = set()
            restarted = {s for r in part for s in r.sample_ids()} if tries else set()
            try:
                gen = replica.actor.generate_stream.options(num_returns="streaming").remote(
                    _call_kwargs(part, options))
                for ref in gen:
                    event = ReplicaClient.get(ref)
                    sample = event["meta_info"]["id"]
                    if sample in restarted:
                        event["meta_info"]["restarted"] = True
                        restarted.discard(sample)
                    if event["meta_info"]["finish_reason"] is not None:
                        finished.add(sample)
                    events.put(("event", event))
                    if closed.is_set():
                        ray.cancel(gen)
                        break
                self._settle(replica, part, None)
                events.put(("done", None))
            except Exception as exc:  # noqa: BLE001 - resubmitted, or passed to the reader
                self._settle(replica, part, None)
                left = [r for r in part if not set(r.sample_ids()) <= finished]
                if _died(exc) and tries < _RESUBMITS and not closed.is_set():
                    self._lost(replica, type(exc).__name__)
                    start(left, tries + 1, {replica.index})
                    events.put(("done", None))
                else:
                    events.put(("error", exc))

        def start(part: list[_Row], tries: int, exclude: set[int]) -> None:
            for replica, positions in self._assign(part, exclude).values():
                counts[0] += 1
                self._pool.submit(pump, replica, [part[j] for j in positions], tries)

        counts = [0]
        start(rows, 0, set())
        try:
            while counts[0]:
                kind, item = events.get()
                if kind == "event":
                    yield item
                elif kind == "done":
                    counts[0] -= 1
                else:
                    raise item
        finally:
            closed.set()

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, *,
                             messages: list | None = None, return_logprob: bool = False,
                             top_logprobs_num: int = 0,
                             lora_name: str | list[str | None] | None = None,
                             cache_salt: str | list[str | None] | None = None,
                             rid: str | list[str | None] | None = None,
                             stream: bool = False, return_routed_experts: bool = False
                             ) -> dict | list[dict] | AsyncIterator[dict]:
        kwargs = dict(locals())
        del kwargs["self"]
        loop = asyncio.get_running_loop()
        if not stream:
            return await loop.run_in_executor(self._pool, lambda: self.generate(**kwargs))
        events = self.generate(**kwargs)
        return _async_events(events, loop, self._pool)

    # weights through the object store; adapters recorded for replicas that join later

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, *, weight_version: str | None = None,
                                   pause_mode: str = "retract",
                                   commit: bool | None = None) -> dict:
        """One `ray.put` of the tensors; every replica reads them from the object store. A
        committing call prepares on every replica (validated and checked while serving goes
        on) and commits on all, so one replica's refusal leaves every replica serving its old
        weights; commit=False stages them on every replica, as an Engine stages."""
        if load_format not in (None, "direct"):
            raise ValueError(f"load_format {load_format!r}: a fleet takes tensors as they are")
        ref = _ray().put(pack_tensors(named_tensors))
        if resolve_commit(commit, flush_cache):
            return self._two_phase(lambda e: e.prepare_tensors(ref), self.members(),
                                   weight_version, pause_mode)
        return self._staged(lambda e: e.update_tensors(
            ref, load_format, flush_cache, weight_version=weight_version,
            pause_mode=pause_mode, commit=False), False, weight_version)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """Dead replicas left the group when they died."""
        with self._lock:
            live = {id(r.client) for r in self._replicas if r.state != "dead"}
        if group_name in self._groups:
            self._groups[group_name] = [m for m in self._groups[group_name] if id(m[1]) in live]
            if not self._groups[group_name]:
                del self._groups[group_name]
                return {"success": True, "message": f"no live replica held {group_name!r}"}
        return super().destroy_weights_update_group(group_name)

    def load_lora_adapter(self, lora_name: str, lora_path: str, *,
                          pause_mode: str = "retract") -> dict:
        result = super().load_lora_adapter(lora_name, lora_path, pause_mode=pause_mode)
        if result["success"]:
            self._adapters[lora_name] = ("load_lora_adapter", (lora_name, lora_path), {})
        return result

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict,
                                       *, pause_mode: str = "retract") -> dict:
        ref = _ray().put(dict(tensors))
        result = super().load_lora_adapter_from_tensors(lora_name, ref, config_dict,
                                                        pause_mode=pause_mode)
        if result["success"]:
            self._adapters[lora_name] = ("load_lora_adapter_from_tensors",
                                         (lora_name, ref, config_dict), {})
        return result

    def unload_lora_adapter(self, lora_name: str) -> dict:
        result = super().unload_lora_adapter(lora_name)
        if result["success"]:
            self._adapters.pop(lora_name, None)
        return result


async def _async_events(events: Iterator[dict], loop: asyncio.AbstractEventLoop,
                        pool: ThreadPoolExecutor) -> AsyncIterator[dict]:
    done = object()
    try:
        while True:
            event = await loop.run_in_executor(pool, next, events, done)
            if event is done:
                return
            yield event
    finally:
        await loop.run_in_executor(pool, events.close)
