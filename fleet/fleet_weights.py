"""FleetWeights: a RayFleet's one weight version, and how a joining replica comes to hold it
(docs/fleet.md#one-weight-version).

The fleet records the version its serving replicas committed and the adapters loaded through
it. A replica that joins later (a replacement, or one added by scale) copies the weights from
a serving replica through the object store, loads the recorded adapters, and serves once it
reports the fleet's version. A copy runs only while no update is open, and holds updates off
until it is done, so the version it copies is still the fleet's when it finishes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from hotswap.fleet.placement import Replica
from hotswap.fleet.replica_client import ReplicaClient


class FleetWeights:
    def __init__(self, update_lock: contextlib.AbstractContextManager[Any],
                 update_open: Callable[[], bool]):
        """update_lock: the lock every update of the fleet holds; update_open: whether an
        update is staged or prepared and not committed yet."""
        self.version = ""
        self._adapters: dict[str, Callable[[ReplicaClient], Any]] = {}  # replayed on joiners
        self._update_lock = update_lock
        self._update_open = update_open

    def record_adapter(self, lora_name: str, load: Callable[[ReplicaClient], Any]) -> None:
        """`load(client)` loads `lora_name` on a replica that joins later."""
        self._adapters[lora_name] = load

    def forget_adapter(self, lora_name: str) -> None:
        self._adapters.pop(lora_name, None)

    @contextlib.contextmanager
    def between_updates(self) -> Iterator[bool]:
        """Holds updates off; yields whether none is open (only then is a copy current)."""
        with self._update_lock:
            yield not self._update_open()

    def copy_to(self, replica: Replica, sources: list[Replica]) -> bool:
        """The fleet's weights (from sources[0], if the replica's version differs) and its
        adapters onto `replica`; True once it holds the fleet's version."""
        client = replica.client
        assert client is not None
        if client.get_weight_version() != self.version:
            if not sources:
                return False
            weights = sources[0].actor.weights_for_transfer.remote()
            client.update_tensors(weights, weight_version=self.version)
        loaded = client.list_lora_adapters()
        for name, load in self._adapters.items():
            if loaded.get(name) is None:
                load(client)
        replica.info["weight_version"] = client.get_weight_version()
        return replica.info["weight_version"] == self.version
