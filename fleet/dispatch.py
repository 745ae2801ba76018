"""Dispatch: a RayFleet's generate over its serving replicas (docs/fleet.md#dispatch).

A batch becomes rows, split as the Engine splits it. Rows with the same prompt (and all
samples of a row) go to one replica: the one that served most of the prompt's prefix if it is
not much busier than the idlest, else the least loaded. Outputs come back in the order given,
or, streamed, as they come. A replica that dies takes no request with it: its rows are sampled
again from the prompt on a live replica, at most RESUBMITS times.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hotswap.engine.client.request import ClassifyRequest, GenerateRequest
from hotswap.fleet.affinity import PrefixAffinity, affinity_key
from hotswap.fleet.placement import Placement, Replica
from hotswap.fleet.replica_client import ReplicaClient, died, ray_module

RESUBMITS = 3  # a request is sampled again at most this many times
# One prompt of a call and its samples: a GenerateRequest of that prompt alone (its split()).
Row = GenerateRequest


class ReplicaGone(RuntimeError):
    """No live replica could take a request (every one died, or the fleet shut down)."""


class Dispatcher:
    def __init__(self, placement: Placement, affinity: PrefixAffinity, pool: ThreadPoolExecutor,
                 stopped: threading.Event, *, lost: Callable[[Replica, str], None],
                 abort: Callable[[str], None], cache_threshold: float, wait_s: float):
        """lost(replica, why): a call found the replica dead; abort(rid): aborts a sample on
        every replica; wait_s: how long a request waits for a serving replica."""
        self.sessions: dict[str, int] = {}  # session id -> the replica index holding it
        self._placement, self._affinity, self._pool = placement, affinity, pool
        self._stopped, self._lost, self._abort = stopped, lost, abort
        self.cache_threshold, self.wait_s = cache_threshold, wait_s

    # choosing replicas

    def session_replica(self, row: Row, serving: list[Replica]) -> Replica | None:
        """The replica holding the row's session. A session whose replica is gone is
        forgotten, and its row runs wherever it fits, without the pin (_body)."""
        session = row.session_id
        if session is None:
            return None
        if session not in self.sessions:
            raise ValueError(f"session_id {session!r}: no such session is open")
        held = [r for r in serving if r.index == self.sessions[session]]
        if not held:
            del self.sessions[session]
        return held[0] if held else None

    def _body(self, rows: list[Row]) -> dict[str, Any]:
        """A replica's generate arguments for `rows` (one call's); the replica streams or not
        as it is asked."""
        rows = [r if r.session_id in self.sessions else r.replace(session_id=None)
                for r in rows]
        return GenerateRequest.join(rows).replace(stream=False).body()

    def _choose(self, row: Row, exclude: set[int]) -> Replica:
        """The session's replica; else prefix affinity if a replica holds most of the prompt
        and is not much busier, else the least loaded; waits for a serving replica while none
        is."""
        key = affinity_key("/generate", {row.kind: row.value, "image_data": row.image_data})
        deadline = time.monotonic() + self.wait_s
        while True:
            with self._placement.lock:
                everyone = self._placement.in_state("serving")
                serving = [r for r in everyone if r.index not in exclude] or everyone
                if serving:
                    chosen = self.session_replica(row, everyone) or self._by_affinity(
                        key, serving) or min(serving,
                                             key=lambda r: (r.inflight, r.requests, r.index))
                    self._charge(chosen, row)
                    if key:
                        self._affinity.insert(key, chosen.index)
                    return chosen
            if self._stopped.is_set() or time.monotonic() > deadline:
                raise ReplicaGone("no serving replica to take the request")
            time.sleep(0.05)

    def _by_affinity(self, key: Any, serving: list[Replica]) -> Replica | None:
        if not key:
            return None
        matches = self._affinity.match(key)
        candidates = [r for r in serving if matches.get(r.index, 0) / len(key)
                      >= self.cache_threshold]
        if not candidates:
            return None
        best = max(candidates, key=lambda r: (matches[r.index], -r.inflight))
        idlest = min(r.inflight for r in serving)
        return best if best.inflight <= 2 * idlest + 16 else None

    def _assign(self, rows: list[Row], exclude: set[int] = frozenset()
                ) -> dict[int, tuple[Replica, list[int]]]:
        """Row positions per replica: rows with the same prompt go together."""
        by_prompt: dict[tuple, Replica] = {}
        plan: dict[int, tuple[Replica, list[int]]] = {}
        for i, row in enumerate(rows):
            same = (row.kind, repr(row.value), row.lora_name, row.cache_salt, row.session_id)
            replica = by_prompt.get(same)
            if replica is None:
                replica = by_prompt[same] = self._choose(row, set(exclude))
            else:
                self._charge(replica, row)
            plan.setdefault(replica.index, (replica, []))[1].append(i)
        return plan

    def _charge(self, replica: Replica, row: Row) -> None:
        with self._placement.lock:
            replica.inflight += row.samples
            replica.requests += row.samples

    def _settle(self, replica: Replica, rows: list[Row], outs: list[dict] | None) -> None:
        with self._placement.lock:
            replica.inflight -= sum(r.samples for r in rows)
            replica.tokens += sum(o["meta_info"].get("completion_tokens", 0)
                                  for o in outs or [])

    # running

    def run(self, rows: list[Row]) -> list[dict]:
        """Every row's outputs, in order; rows of a replica that died run again elsewhere
        (meta_info "resubmitted"). The first other failure aborts the rest and is raised."""
        ray = ray_module()
        results: dict[int, list[dict]] = {}
        pending: dict[Any, tuple[Replica, list[int], int]] = {}
        failure: BaseException | None = None

        def submit(positions: list[int], tries: int, exclude: set[int]) -> None:
            for replica, part in self._assign([rows[i] for i in positions], exclude).values():
                chosen = [positions[j] for j in part]
                ref = replica.actor.generate.remote(self._body([rows[i] for i in chosen]))
                pending[ref] = (replica, chosen, tries)

        submit(list(range(len(rows))), 0, set())
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            replica, positions, tries = pending.pop(ready[0])
            try:
                outs = ReplicaClient.get(ready[0])
            except Exception as exc:  # noqa: BLE001 - resubmitted, or raised below
                self._settle(replica, [rows[i] for i in positions], None)
                if died(exc) and tries < RESUBMITS and failure is None:
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

    def classify(self, request: ClassifyRequest) -> dict | list[dict]:
        """A classify call on one replica, chosen as a generate row of its first prompt is
        (the replica holding that prefix, else the least loaded); if the replica dies, the
        call runs again on another, at most RESUBMITS times. Bad input raises here first."""
        first = request.split()[0][0]
        route = GenerateRequest(**{first.kind: first.value})
        exclude: set[int] = set()
        while True:
            replica = self._choose(route, exclude)
            try:
                return replica.client.classify(**request.body())
            except Exception as exc:
                if not died(exc) or len(exclude) >= RESUBMITS:
                    raise
                self._lost(replica, type(exc).__name__)
                exclude.add(replica.index)
            finally:
                self._settle(replica, [route], None)

    def _abort_rows(self, rows: list[Row]) -> None:
        for row in rows:
            for sample in row.sample_ids():
                self._abort(sample)

    def stream(self, rows: list[Row]) -> Iterator[dict]:
        """Every replica's events, merged as they come. A sample whose replica died starts
        again from its prompt; its next event carries meta_info "restarted": True (drop what
        it had streamed)."""
        events: queue.Queue[tuple[str, Any]] = queue.Queue()
        closed = threading.Event()

        def pump(replica: Replica, part: list[Row], tries: int) -> None:
            ray = ray_module()
            finished: set[str] = set()
            restarted = {s for r in part for s in r.sample_ids()} if tries else set()
            try:
                gen = replica.actor.generate_stream.options(num_returns="streaming").remote(
                    self._body(part))
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
                if died(exc) and tries < RESUBMITS and not closed.is_set():
                    self._lost(replica, type(exc).__name__)
                    start(left, tries + 1, {replica.index})
                    events.put(("done", None))
                else:
                    events.put(("error", exc))

        def start(part: list[Row], tries: int, exclude: set[int]) -> None:
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


async def async_events(events: Iterator[dict], loop: asyncio.AbstractEventLoop,
                       pool: ThreadPoolExecutor) -> AsyncIterator[dict]:
    """A stream's events read on `pool`'s threads, for an async caller."""
    done = object()
    try:
        while True:
            event = await loop.run_in_executor(pool, next, events, done)
            if event is done:
                return
            yield event
    finally:
        await loop.run_in_executor(pool, events.close)
