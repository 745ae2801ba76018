"""Health: finding dead replicas and putting new ones in their place (docs/fleet.md#faults).

A thread asks every live replica for its info() each period, which finds a dead replica within
about two periods (a failed call finds one sooner). A dead replica serves nothing more and a
new actor takes its bundle; one that misses 5 checks in a row is killed and replaced the same
way. A replica that joins (a replacement, one that scale adds, or a serving one an update left
out) catches up: it copies the fleet's weights and adapters, and only then serves.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from hotswap.fleet.affinity import PrefixAffinity
from hotswap.fleet.fleet_weights import FleetWeights
from hotswap.fleet.placement import Placement, Replica
from hotswap.fleet.replica_client import ReplicaClient, died, ray_module

logger = logging.getLogger("hotswap.fleet")

MAX_MISSES = 5  # health checks in a row without an answer before a replica is killed


class Health:
    def __init__(self, placement: Placement, weights: FleetWeights, affinity: PrefixAffinity,
                 pool: ThreadPoolExecutor, stopped: threading.Event, period_s: float):
        self._placement, self._weights, self._affinity = placement, weights, affinity
        self._pool, self._stopped, self.period_s = pool, stopped, period_s
        self._thread = threading.Thread(target=self._watch, name="fleet-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.wait(self.period_s):
            live = [r for r in self._placement.in_state("joining", "serving", "draining")
                    if r.client]
            refs = {r.actor.info.remote(): r for r in live}
            if not refs:
                continue
            ready, late = ray_module().wait(list(refs), num_returns=len(refs),
                                            timeout=max(2.0, 2 * self.period_s))
            for ref in ready:
                replica = refs[ref]
                try:
                    replica.info.update(ReplicaClient.get(ref))
                    replica.misses = 0
                except Exception as exc:  # noqa: BLE001 - any failure of a health check
                    if died(exc):
                        self.lost(replica, f"{type(exc).__name__}")
            for ref in late:
                replica = refs[ref]
                replica.misses += 1
                if replica.misses >= MAX_MISSES:
                    ray_module().kill(replica.actor, no_restart=True)
                    self.lost(replica, f"no answer to {MAX_MISSES} health checks")

    def lost(self, replica: Replica, why: str) -> None:
        """A replica died: it serves nothing more and a new actor takes its bundle (a
        draining one only leaves)."""
        with self._placement.lock:
            if replica.state == "dead" or self._stopped.is_set():
                return
            draining = replica.state == "draining"
            replica.state = "dead"
            self._affinity.forget_server(replica.index)
        logger.warning("replica %d died (%s)", replica.index, why)
        if draining:
            self._placement.release(replica)
        else:
            self._pool.submit(self._replace, replica)

    def _replace(self, dead: Replica) -> None:
        """A new actor in the dead one's bundle (retried until it starts: Ray may first have
        to move the bundle to a live node); it serves once it caught up."""
        while not self._stopped.is_set():
            replica = self._placement.start_in(dead.slot)
            try:
                self._placement.await_started(replica)
            except Exception:  # noqa: BLE001 - logged and retried
                logger.exception("replacing replica %d failed; retrying", dead.index)
                self._placement.remove(replica)
                with contextlib.suppress(Exception):
                    ray_module().kill(replica.actor, no_restart=True)
                time.sleep(1.0)
                continue
            self._placement.remove(dead)
            self.catch_up(replica)
            return

    def catch_up(self, replica: Replica) -> None:
        """Copies the fleet's weights (and adapters) from a serving replica, then serves;
        retried while an update is open or the copy fails."""
        while not self._stopped.is_set() and replica.state == "joining":
            with self._weights.between_updates() as quiet:
                if quiet and self._copy(replica):
                    return
            time.sleep(0.2)

    def _copy(self, replica: Replica) -> bool:
        """True when the replica is done joining: it serves, or it died."""
        sources = [r for r in self._placement.in_state("serving") if r is not replica]
        try:
            if not self._weights.copy_to(replica, sources):
                return False
        except Exception as exc:  # noqa: BLE001 - retried, or the replica died
            if died(exc):
                self.lost(replica, type(exc).__name__)
                return True
            logger.warning("replica %d could not catch up: %s", replica.index, exc)
            return False
        with self._placement.lock:
            if replica.state == "joining":
                replica.state = "serving"
        logger.info("replica %d serves version %r", replica.index, self._weights.version)
        return True
