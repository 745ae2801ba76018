"""Placement: where a RayFleet's replicas run, and the table of them (docs/fleet.md#placement).

Each replica is an `EngineReplica` actor in one bundle of a placement group: the fleet's own
(made as replicas are needed, packed or spread over nodes) or the caller's. The table lists
every replica with its state and counters; its lock is the one that dispatch, the health
thread and scaling take to read or change a replica. A replica goes starting -> joining ->
serving (-> draining) -> dead, and a bundle is free again once its replica left the table.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from hotswap.fleet.replica import EngineReplica
from hotswap.fleet.replica_client import ReplicaClient, ray_module

PLACEMENTS = {"pack": "PACK", "spread": "STRICT_SPREAD"}


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica runs and how the fleet places it."""

    model_path: str
    engine_kwargs: dict[str, Any]  # tp_size included
    resources: dict[str, float]  # one bundle
    placement: str = "pack"  # a key of PLACEMENTS
    http: bool = False
    max_concurrency: int = 256
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {sorted(PLACEMENTS)}, "
                             f"got {self.placement!r}")


@dataclass(eq=False)
class Replica:
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


class Placement:
    def __init__(self, spec: ReplicaSpec, placement_group: Any = None):
        """With `placement_group` replica i takes its bundle i and the fleet makes no group."""
        self.spec = spec
        self.lock = threading.RLock()  # the replicas, their states and counters
        self.replicas: list[Replica] = []
        self._indices = itertools.count()
        self._own_groups: list[Any] = []
        self._slots: list[tuple[Any, int]] = []  # (placement group, bundle index)
        self._free_slots: list[int] = []
        if placement_group is not None:
            self._slots = [(placement_group, i) for i in range(placement_group.bundle_count)]
            self._free_slots = list(range(len(self._slots)))

    def in_state(self, *states: str) -> list[Replica]:
        with self.lock:
            return [r for r in self.replicas if r.state in states]

    def info(self) -> list[dict[str, Any]]:
        with self.lock:
            return [{"index": r.index, "state": r.state, "pid": r.info.get("pid"),
                     "node_id": r.info.get("node_id"), "url": r.info.get("url"),
                     "weight_version": r.info.get("weight_version"),
                     "running": r.info.get("running", 0), "waiting": r.info.get("waiting", 0),
                     "requests": r.requests, "tokens": r.tokens} for r in self.replicas]

    # starting

    def start(self, count: int) -> list[Replica]:
        """`count` new actors in free bundles; their models load in the background."""
        self._reserve(count)
        return [self.start_in(self._take_slot()) for _ in range(count)]

    def start_in(self, slot: int) -> Replica:
        """A new actor in bundle `slot` (a dead replica's, for its replacement)."""
        ray = ray_module()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self.spec
        group, bundle = self._slots[slot]
        extra = {k: v for k, v in spec.resources.items() if k not in ("CPU", "GPU")}
        actor_class = ray.remote(EngineReplica).options(
            num_cpus=spec.resources.get("CPU", 0), num_gpus=spec.resources.get("GPU", 0),
            resources=extra or None, max_concurrency=spec.max_concurrency, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=True))
        replica = Replica(next(self._indices), slot)
        # Each replica its own sampling seed: requests that differ never share random streams.
        seed = spec.engine_kwargs.get("seed", 0) + replica.index
        replica.actor = actor_class.remote(spec.model_path, {**spec.engine_kwargs, "seed": seed},
                                           0 if spec.http else None)
        with self.lock:
            self.replicas.append(replica)
        return replica

    def await_started(self, replica: Replica) -> None:
        """Waits for the model to load; the replica then joins (it serves once it caught up)."""
        info = ReplicaClient.get(replica.actor.info.remote(), timeout=self.spec.start_timeout_s)
        replica.info = info
        replica.client = ReplicaClient(replica.actor, info["weight_sync_ranks"],
                                       f"replica {replica.index}")
        replica.state = "joining"

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
        self._grow(missing)

    def _take_slot(self) -> int:
        with self.lock:
            return self._free_slots.pop(0)

    def _grow(self, count: int) -> None:
        """Adds `count` bundles in a new placement group of the fleet's own."""
        ray = ray_module()
        spec = self.spec
        group = ray.util.placement_group([dict(spec.resources)] * count,
                                         strategy=PLACEMENTS[spec.placement])
        ready, _ = ray.wait([group.ready()], timeout=spec.start_timeout_s)
        if not ready:
            ray.util.remove_placement_group(group)
            raise RuntimeError(f"Ray could not place {count} bundle(s) of {spec.resources} "
                               f"with placement {spec.placement!r} within "
                               f"{spec.start_timeout_s} s (not enough nodes or resources)")
        self._own_groups.append(group)
        first = len(self._slots)
        self._slots += [(group, i) for i in range(count)]
        self._free_slots += list(range(first, first + count))

    # leaving

    def remove(self, replica: Replica) -> None:
        """Takes `replica` out of the table; its bundle stays taken (a replacement has it)."""
        with self.lock:
            if replica in self.replicas:
                self.replicas.remove(replica)

    def release(self, replica: Replica) -> None:
        """`replica` is dead and out of the table, and its bundle free."""
        with self.lock:
            replica.state = "dead"
            self.remove(replica)
            self._free_slots.append(replica.slot)

    def stop(self) -> None:
        """Stops every replica and removes the fleet's placement groups."""
        ray = ray_module()
        with self.lock:
            actors = [r.actor for r in self.replicas if r.actor is not None]
            for r in self.replicas:
                r.state = "dead"
        for ref in [a.shutdown.remote() for a in actors]:
            with contextlib.suppress(Exception):  # dead or stuck: killed below
                ray.get(ref, timeout=30)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        for group in self._own_groups:
            ray.util.remove_placement_group(group)
