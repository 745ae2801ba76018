"""RayFleet: engine replicas as Ray actors, one EngineClient (docs/fleet.md#ray-fleet).

Each replica is an `EngineReplica` actor in one bundle of a placement group (placement.py).
A replica goes starting -> joining -> serving: it takes requests and updates only once it
holds the fleet's weight version, copied from a serving replica through the object store
(fleet_weights.py). A health check finds dead replicas within about two periods; their
requests are sampled again on live replicas (dispatch.py) and a new actor takes the same
bundle (health.py). Control calls and updates are the Coordinator's (all serving replicas,
all or none); the members an update starts with are the ones it ends with, and a replica
still joining is left out and catches up after it.

Beside its policy a fleet may hold frozen models (`extra_models`: a reward model, a judge),
each a fleet of its own (`fleet.models[name]`): a request or update naming one (`model=`) goes
to it; everything else, weight updates included, is the policy's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hotswap.engine.client.protocol import resolve_commit
from hotswap.engine.client.request import ClassifyRequest, GenerateRequest
from hotswap.fleet.affinity import PrefixAffinity
from hotswap.fleet.coordinator import Member
from hotswap.fleet.dispatch import Dispatcher, ReplicaGone, async_events
from hotswap.fleet.extra_models import ExtraModels, by_model
from hotswap.fleet.fleet_weights import FleetWeights
from hotswap.fleet.health import Health
from hotswap.fleet.placement import Placement, Replica, ReplicaSpec
from hotswap.fleet.replica import pack_tensors
from hotswap.fleet.replica_client import ReplicaClient, ray_module
from hotswap.weight_sync.delta import Delta

logger = logging.getLogger("hotswap.fleet")

class RayFleet(ExtraModels):
    def __init__(self, model_path: str, replicas: int = 1, tp_size: int = 1,
                 engine_kwargs: dict | None = None,
                 resources_per_replica: dict[str, float] | None = None,
                 placement: str = "pack", placement_group: Any = None, *,
                 http: bool = False, health_period_s: float = 1.0,
                 start_timeout_s: float = 600.0, cache_threshold: float = 0.5,
                 max_concurrency: int = 256,
                 extra_models: dict[str, dict[str, Any]] | None = None):
        """replicas Engine(model_path, tp_size=tp_size, **engine_kwargs) actors, each in one
        bundle of `resources_per_replica` ({"CPU": 1} by default; {"GPU": tp_size} on GPUs).
        placement "pack" or "spread" (one replica per node) applies to the fleet's own
        placement group; with `placement_group` replica i takes its bundle i. `http`: each
        replica also serves the engine's HTTP API (its URL in replicas_info).
        extra_models: name -> {"model_path", optionally FLEET_ARGS (extra_models.py; replicas:
        1), and its EngineConfig kwargs}: frozen models served beside the policy under that
        name, each a fleet of its own (`models[name]`)."""
        super().__init__()
        self._extras: dict[str, RayFleet] = {}
        self._open_on: RayFleet | None = None  # an extra model's fleet holding an update open
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
        spec = ReplicaSpec(model_path, {**(engine_kwargs or {}), "tp_size": tp_size},
                           dict(resources_per_replica or {"CPU": 1}), placement, http,
                           max_concurrency, start_timeout_s)
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        ray = ray_module()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(include_dashboard=False, configure_logging=False)
        self.model_path = model_path
        self.affinity = PrefixAffinity()
        self._stopped = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency,
                                        thread_name_prefix="fleet-call")
        self._placement = Placement(spec, placement_group)
        self._weights = FleetWeights(self._update_lock, lambda: self._staged_on is not None)
        self._health = Health(self._placement, self._weights, self.affinity, self._pool,
                              self._stopped, health_period_s)
        self._dispatch = Dispatcher(self._placement, self.affinity, self._pool, self._stopped,
                                    lost=self._health.lost, abort=self.abort_request,
                                    cache_threshold=cache_threshold, wait_s=start_timeout_s)
        try:
            self._start_first(replicas)
            self._health.start()
            self._start_extras(extra_models or {}, http=http, health_period_s=health_period_s,
                               start_timeout_s=start_timeout_s, cache_threshold=cache_threshold,
                               max_concurrency=max_concurrency)
        except BaseException:
            self.shutdown()
            raise

    def _start_first(self, count: int) -> None:
        """The first replicas serve at once: they all loaded the same checkpoint."""
        started = self._placement.start(count)
        for replica in started:
            self._placement.await_started(replica)
        versions = {r.info["weight_version"] for r in started}
        if len(versions) != 1:
            raise RuntimeError(f"fresh replicas disagree on their version: {versions}")
        self._weights.version = versions.pop()
        self._model_name = started[0].info["model_name"]
        for replica in started:
            replica.state = "serving"

    def __repr__(self) -> str:
        return f"RayFleet({self.model_path!r}, replicas={len(self._serving())})"

    @property
    def version(self) -> str:
        """The weight version every serving replica holds."""
        return self._weights.version

    @property
    def model_name(self) -> str:
        """The policy's served name (`models` maps every model's to its fleet)."""
        return self._model_name

    # members and states

    def _serving(self) -> list[Replica]:
        return self._placement.in_state("serving")

    def members(self) -> list[Member]:
        return [(r.client.label, r.client) for r in self._serving()]

    @property
    def weight_sync_members(self) -> tuple[int, ...]:
        """The replicas a weight group made now would hold; a WeightSender re-forms its group
        when this changes (a replica died, joined or left)."""
        return tuple(r.index for r in self._serving())

    def replicas_info(self) -> list[dict[str, Any]]:
        return self._placement.info()

    def _on_commit(self, version: str, members: list[Member]) -> str:
        """Serving replicas outside the update (they joined meanwhile) go back to joining
        and copy the new weights before they serve again."""
        clients = {id(c) for _, c in members}
        with self._placement.lock:
            self._weights.version = version
            for r in self._placement.replicas:
                if r.state == "serving" and id(r.client) in clients:
                    r.info["weight_version"] = version
            stale = [r for r in self._placement.in_state("serving", "joining", "starting")
                     if id(r.client) not in clients]
            for r in stale:
                if r.state == "serving":
                    r.state = "joining"
                    self._pool.submit(self._health.catch_up, r)
        if not stale:
            return ""
        return (f"; left out {', '.join(f'replica {r.index} ({r.state})' for r in stale)}: it "
                "copies these weights before it serves")

    # size

    def scale(self, replicas: int, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Grows or shrinks to `replicas` serving replicas between steps. New replicas take
        requests once they hold the fleet's weights; removed ones finish their requests
        first. Returns replicas_info()."""
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
        deadline = time.monotonic() + (timeout_s or self._placement.spec.start_timeout_s)
        live = self._placement.in_state("starting", "joining", "serving")
        if replicas > len(live):
            added = self._placement.start(replicas - len(live))
            for replica in added:
                self._placement.await_started(replica)
                self._pool.submit(self._health.catch_up, replica)
            self._wait(lambda: all(r.state != "joining" for r in added), deadline, "join")
        else:
            ordered = sorted(live, key=lambda r: (r.state == "serving", -r.index))
            for replica in ordered[:len(live) - replicas]:
                self._drain(replica, deadline)
        return self.replicas_info()

    def _drain(self, replica: Replica, deadline: float) -> None:
        with self._placement.lock:
            replica.state = "draining"
            self.affinity.forget_server(replica.index)
        self._wait(lambda: replica.inflight == 0, deadline, "drain")
        if replica.client is not None:
            try:
                ReplicaClient.get(replica.actor.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - it is being removed anyway
                logger.debug("replica %d: shutdown failed", replica.index, exc_info=True)
        ray_module().kill(replica.actor, no_restart=True)
        self._placement.release(replica)

    def _wait(self, done: Callable[[], bool], deadline: float, what: str) -> None:
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
        for extra in self._extras.values():
            extra.shutdown()
        self._placement.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_ray:
            ray_module().shutdown()

    # generation

    def _generate(self, request: GenerateRequest) -> dict | list[dict] | Iterator[dict]:
        """Rows with the same prompt (and all samples of a row) go to one replica; outputs
        come back in the order given. A replica that dies takes no request with it: its rows
        are sampled again from the prompt on a live replica (meta_info "resubmitted")."""
        target = self._fleet_for(request.model)
        if target is not self:
            return target._generate(request)
        rows, single = request.split()
        if request.stream:
            return self._dispatch.stream(rows)
        outs = self._dispatch.run(rows)
        return outs[0] if single and len(outs) == 1 else outs

    async def _async_generate(self, request: GenerateRequest
                              ) -> dict | list[dict] | AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        if not request.stream:
            return await loop.run_in_executor(self._pool, lambda: self._generate(request))
        return async_events(self._generate(request), loop, self._pool)

    # scoring: one replica scores a call (dispatch.py)

    def _classify(self, request: ClassifyRequest) -> dict | list[dict]:
        target = self._fleet_for(request.model)
        if target is not self:
            return target._classify(request)
        return self._dispatch.classify(request)

    async def _async_classify(self, request: ClassifyRequest) -> dict | list[dict]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: self._classify(request))

    # sessions: each stays on the replica that opened it (a row of a session whose replica
    # died runs elsewhere, without the pin)

    def open_session(self, ttl_s: float = 300.0, session_id: str | None = None) -> str:
        serving = self._serving()
        if not serving:
            raise ReplicaGone("no serving replica to hold the session")
        replica = min(serving, key=lambda r: (r.inflight, r.requests, r.index))
        session = replica.client.open_session(ttl_s, session_id)
        self._dispatch.sessions[session] = replica.index
        return session

    def close_session(self, session_id: str) -> bool:
        index = self._dispatch.sessions.pop(session_id, None)
        held = [r for r in self._serving() if r.index == index]
        return bool(held) and held[0].client.close_session(session_id)

    # weights through the object store; adapters recorded for replicas that join later

    @by_model
    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, *, weight_version: str | None = None,
                                   pause_mode: str = "retract", commit: bool | None = None,
                                   model: str | None = None) -> dict:
        """One `ray.put` of the tensors; every replica reads them from the object store. A
        committing call prepares on every replica (validated and checked while serving goes
        on) and commits on all, so one replica's refusal leaves every replica serving its old
        weights; commit=False stages them on every replica, as an Engine stages."""
        commit = resolve_commit(commit, flush_cache)
        if (load_format == "delta") != isinstance(named_tensors, Delta):
            raise ValueError('load_format="delta" goes with a Delta (hotswap.weight_sync), and a '
                             "Delta with it")
        if load_format == "delta":  # small: into the store as it is, prepared on every replica
            if not commit or self._pieces_open():
                raise ValueError("a delta commits as one update: not with commit=False pieces")
            delta_ref = ray_module().put(named_tensors)
            return self._two_phase(lambda e: e.prepare_tensors(delta_ref, model),
                                   self.members(), weight_version, pause_mode)
        if load_format not in (None, "direct"):
            raise ValueError(f"load_format {load_format!r}: a fleet takes tensors as they are")
        ref = ray_module().put(pack_tensors(named_tensors))
        if commit and not self._pieces_open():
            return self._two_phase(lambda e: e.prepare_tensors(ref, model), self.members(),
                                   weight_version, pause_mode)
        return self._staged(lambda e: e.update_tensors(
            ref, load_format, flush_cache, weight_version=weight_version,
            pause_mode=pause_mode, commit=False, model=model), commit, weight_version)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """Dead replicas left the group when they died."""
        live = {id(r.client) for r in self._placement.in_state(
            "starting", "joining", "serving", "draining")}
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
            self._weights.record_adapter(
                lora_name, lambda client: client.load_lora_adapter(lora_name, lora_path))
        return result

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict,
                                       *, pause_mode: str = "retract") -> dict:
        ref = ray_module().put(dict(tensors))
        result = super().load_lora_adapter_from_tensors(lora_name, ref, config_dict,
                                                        pause_mode=pause_mode)
        if result["success"]:
            self._weights.record_adapter(lora_name, lambda client: (
                client.load_lora_adapter_from_tensors(lora_name, ref, config_dict)))
        return result

    def unload_lora_adapter(self, lora_name: str) -> dict:
        result = super().unload_lora_adapter(lora_name)
        if result["success"]:
            self._weights.forget_adapter(lora_name)
        return result
