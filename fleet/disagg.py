"""PDRouter: prefill and decode engines as one EngineClient (docs/fleet.md#prefill-and-decode).

A request's prompt is computed on a prefill engine (Engine.prefill: its KV and first token),
handed to a decode engine with its namespace and checksum (engine/kvcache/handoff.py), and
decoded there (generate_from_handoff). Long prompts then never share a step with the decodes.

Both roles are members of one Coordinator, so a weight update prepares on every prefill and
decode engine and commits on all or none: the pair serves one version. A handoff computed under
a version the decode engine no longer serves is refused there and the prompt recomputed under
the one it does; the per-token versions show the split.

Faults: a prefill engine that fails (dies, or its transfer does) is skipped for a while and the
request prefilled on another, or by the decode engine itself when none is left; a decode engine
that fails is skipped and the request served again from its prompt, at most RESUBMITS times (a
stream only if it fails before its first event, so no token is sent twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hotswap.engine.client.protocol import KV_TRANSPORTS
from hotswap.engine.client.request import ClassifyRequest, GenerateRequest
from hotswap.fleet.coordinator import Coordinator, Member
from hotswap.fleet.dispatch import ReplicaGone
from hotswap.fleet.replica import EngineReplica
from hotswap.fleet.replica_client import ReplicaClient, ray_module
from hotswap.weight_sync.serialize import serialize_named_tensors

RESUBMITS = 3
_DOWN_FOR_S = 5.0
_END = object()


class PDRouter(Coordinator):
    def __init__(self, prefill: Sequence[Any], decode: Sequence[Any],
                 transport: str = "auto", max_workers: int = 64):
        """prefill / decode: engines (Engine, RemoteEngine) started with role="prefill" /
        role="decode" (or "both"). transport: how KV travels, "inline" (engines of this
        process), "shm" (servers on this host), "group" (after init_kv_transfer_group), or
        "auto": inline when every engine is in this process, else shm."""
        super().__init__()
        if not prefill or not decode:
            raise ValueError("a PDRouter needs at least one prefill and one decode engine")
        if transport not in ("auto", *KV_TRANSPORTS):
            raise ValueError(f"transport must be 'auto' or one of {KV_TRANSPORTS}, got "
                             f"{transport!r}")
        self.prefill_engines, self.decode_engines = list(prefill), list(decode)
        if transport == "auto":
            local = all(hasattr(e, "scheduler") for e in self.prefill_engines
                        + self.decode_engines)
            transport = "inline" if local else "shm"
        self.transport = transport
        self._inflight = {id(e): 0 for e in self.prefill_engines + self.decode_engines}
        self._down_until = {id(e): 0.0 for e in self.prefill_engines + self.decode_engines}
        self._ranks: dict[int, int] = {}  # engine -> its rank in the KV transfer group
        self._actors: list[Any] = []  # on_ray's, stopped by shutdown()
        self._lock = threading.Lock()
        # rows; and, apart (a row waits on its send), the sends of "group" handoffs
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pd")
        self._senders = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pd-send")
        self.stats = {"handoffs": 0, "prefill_failures": 0,
                      "decode_failures": 0, "local_prefills": 0}

    @classmethod
    def on_ray(cls, model_path: str, prefill: int = 1, decode: int = 1,
               engine_kwargs: dict | None = None, resources_per_engine: dict | None = None,
               transport: str = "group", start_timeout_s: float = 600.0) -> PDRouter:
        """Start `prefill` + `decode` engines as Ray actors (EngineReplica, one bundle of
        resources_per_engine each, {"CPU": 1} by default; Ray's own placement puts them on
        any node) and front them. transport: "group" (any nodes: KV over gloo, or NCCL with
        GPUs), "shm" (all on one node) or "inline" (through Ray's object store).
        shutdown() stops the actors."""
        ray = ray_module()
        if not ray.is_initialized():
            ray.init()
        res = dict(resources_per_engine or {"CPU": 1})
        extra = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
        actor_class = ray.remote(EngineReplica).options(
            num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0), resources=extra or None,
            max_concurrency=64, max_restarts=0)
        kwargs = dict(engine_kwargs or {})
        roles = ["prefill"] * prefill + ["decode"] * decode
        actors = [actor_class.remote(model_path, {**kwargs, "role": role,
                                                  "seed": kwargs.get("seed", 0) + i})
                  for i, role in enumerate(roles)]
        try:
            infos = [ReplicaClient.get(a.info.remote(), timeout=start_timeout_s) for a in actors]
            clients = [ReplicaClient(a, info["weight_sync_ranks"], f"{role} actor {i}")
                       for i, (a, info, role) in enumerate(zip(actors, infos, roles))]
            router = cls(clients[:prefill], clients[prefill:],
                         transport="shm" if transport == "group" else transport)
            router._actors = actors
            if transport == "group":
                port = ReplicaClient.get(actors[0].free_port.remote())
                router.init_kv_transfer_group(infos[0]["node_ip"], port)
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            raise
        return router

    def __repr__(self) -> str:
        return (f"PDRouter(prefill={len(self.prefill_engines)}, "
                f"decode={len(self.decode_engines)}, transport={self.transport!r})")

    def members(self) -> list[Member]:
        return ([(f"prefill[{i}]", e) for i, e in enumerate(self.prefill_engines)]
                + [(f"decode[{i}]", e) for i, e in enumerate(self.decode_engines)])

    @property
    def model_name(self) -> str:
        """The model every engine of the pairs serves."""
        return self._same(self.call_each(lambda e: e.model_name), "served model name")

    def shutdown(self) -> None:
        """Stops the router's threads; the engines keep running (their owner shuts them),
        except the actors of `on_ray`, which stop here."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._senders.shutdown(wait=False, cancel_futures=True)
        if self._actors:
            ray = ray_module()
            for actor in self._actors:
                with contextlib.suppress(Exception):
                    ReplicaClient.get(actor.shutdown.remote(), timeout=30)
                ray.kill(actor)
            self._actors = []

    # the KV transfer group: every prefill and decode engine, one rank each

    def init_kv_transfer_group(self, master_address: str, master_port: int,
                               group_name: str = "kv_transfer", backend: str = "auto") -> dict:
        """Join every engine to one process group (prefill engines first) and send KV over it
        from now on (transport "group")."""
        engines = self.prefill_engines + self.decode_engines
        results = self.call_each_indexed(lambda i, e: e.init_kv_transfer_group(
            master_address, master_port, i, len(engines), group_name, backend))
        failed = [label for label, r in results if isinstance(r, BaseException)]
        if failed:
            raise RuntimeError(f"init_kv_transfer_group failed on {failed}: "
                               f"{[r for _, r in results if isinstance(r, BaseException)]}")
        self._ranks = {id(e): i for i, e in enumerate(engines)}
        self.transport = "group"
        return {"success": True, "message": f"{len(engines)} engines in {group_name!r}"}

    # choosing engines

    def _pick(self, engines: list[Any], exclude: set[int]) -> Any | None:
        with self._lock:
            now = time.monotonic()
            live = [e for e in engines if id(e) not in exclude]
            up = [e for e in live if self._down_until[id(e)] <= now]
            if not up:
                return None
            engine = min(up, key=lambda e: self._inflight[id(e)])
            self._inflight[id(engine)] += 1
            return engine

    def _release(self, engine: Any, failed: bool = False) -> None:
        with self._lock:
            self._inflight[id(engine)] -= 1
            if failed:
                self._down_until[id(engine)] = time.monotonic() + _DOWN_FOR_S

    def load(self) -> dict[str, list[int]]:
        """Requests in flight on each prefill and decode engine."""
        with self._lock:
            return {"prefill": [self._inflight[id(e)] for e in self.prefill_engines],
                    "decode": [self._inflight[id(e)] for e in self.decode_engines]}

    # generation

    def _generate(self, request: GenerateRequest) -> dict | list[dict] | Iterator[dict]:
        if request.session_id is not None:
            raise ValueError("session_id: sessions pin a conversation's KV on one engine; a "
                             "prefill/decode pair does not serve them")
        rows, single = request.split()
        if request.stream:
            return self._merged([self._pool.submit(self._row, row) for row in rows])
        jobs = [self._pool.submit(self._row, row) for row in rows]
        outs = [out for job in jobs for out in _listed(job.result())]
        return outs[0] if single and len(outs) == 1 else outs

    async def _async_generate(self, request: GenerateRequest
                              ) -> dict | list[dict] | AsyncIterator[dict]:
        out = await asyncio.to_thread(lambda: self._generate(request))
        return _async_events(out) if request.stream else out

    def _classify(self, request: ClassifyRequest) -> dict | list[dict]:
        raise ValueError("classify: a prefill/decode pair serves a model that generates; "
                         "serve a reward model on its own engine, Router or RayFleet")

    async def _async_classify(self, request: ClassifyRequest) -> dict | list[dict]:
        return self._classify(request)

    def _row(self, row: GenerateRequest) -> Any:
        """One prompt (and its n samples): prefill, hand off, decode; resubmitted when a
        decode engine fails before anything reached the caller."""
        failed_decoders: set[int] = set()
        for _ in range(RESUBMITS + 1):
            decoder = self._pick(self.decode_engines, failed_decoders)
            if decoder is None:
                raise ReplicaGone("no decode engine is serving")
            first, prefiller = None, None
            try:
                first, prefiller = self._prefill(row)
                out = self._decode(decoder, first, prefiller, row)
                if row.stream:  # its first event here: a failure before it is resubmitted
                    return self._held(decoder, out, first, next(out, _END))
            except (ValueError, PermissionError):
                self._release(decoder)
                raise
            except Exception:  # noqa: BLE001 - the decode engine failed: serve it elsewhere
                _drop(first, prefiller)
                self._release(decoder, failed=True)
                self.stats["decode_failures"] += 1
                failed_decoders.add(id(decoder))
                continue
            self._release(decoder)
            return out
        raise ReplicaGone(f"request {row.rid}: every decode engine tried failed")

    def _prefill(self, row: GenerateRequest) -> tuple[dict | None, Any]:
        """The prefill output to hand off and the engine that made it, or (None, None): the
        decode engine computes the prompt (no prefill engine could)."""
        failed: set[int] = set()
        first_sample = row.replace(rid=row.sample_ids()[0], stream=False,
                                   sampling_params={**(row.sampling_params or {}), "n": 1})
        while True:
            engine = self._pick(self.prefill_engines, failed)
            if engine is None:
                self.stats["local_prefills"] += 1
                return None, None
            try:
                first = engine.prefill(**first_sample.body(), transport=self.transport)
            except (ValueError, PermissionError):
                self._release(engine)
                raise
            except Exception:  # noqa: BLE001 - this prefill engine failed: try another
                self._release(engine, failed=True)
                self.stats["prefill_failures"] += 1
                failed.add(id(engine))
                continue
            self._release(engine)
            if "kv_handoff" not in first["meta_info"]:  # aborted there: computed again below
                self.stats["local_prefills"] += 1
                return None, None
            return first, engine

    def _decode(self, decoder: Any, first: dict | None, prefiller: Any,
                row: GenerateRequest) -> Any:
        if first is None:
            return decoder.generate(**row.body())
        sending = None
        if self.transport == "group":  # the decode engine receives while the prefill sends
            sending = self._senders.submit(prefiller.send_kv_handoff,
                                        first["meta_info"]["kv_handoff"]["id"],
                                        self._ranks[id(decoder)])
        try:
            out = decoder.generate_from_handoff(
                first, **row.replace(prompt=None, input_ids=None, messages=None).body())
        finally:
            if sending is not None:
                sending.exception()  # a failed send shows as a refused handoff in `out`
        self.stats["handoffs"] += 1
        return out

    def _held(self, decoder: Any, events: Iterator[dict], first: dict | None, head: Any
              ) -> Iterator[dict]:
        """A row's stream: the prefill's first token, then the decode engine's events (the
        first of them, `head`, already read)."""
        try:
            if first is not None and _continues(first):
                yield _first_event(first)
            if head is not _END:
                yield head
                yield from events
        finally:
            self._release(decoder)

    def _merged(self, jobs: list[Any]) -> Iterator[dict]:
        """Every row's stream, as events come."""
        events: queue.Queue = queue.Queue()

        def pump(job: Any) -> None:
            try:
                for event in job.result():
                    events.put(event)
            except BaseException as exc:  # noqa: BLE001 - raised in the consumer
                events.put(exc)
            events.put(_END)

        for job in jobs:
            threading.Thread(target=pump, args=(job,), daemon=True).start()
        done = 0
        while done < len(jobs):
            event = events.get()
            if event is _END:
                done += 1
            elif isinstance(event, BaseException):
                raise event
            else:
                yield event

    # sessions are one engine's

    def open_session(self, ttl_s: float = 300.0, session_id: str | None = None) -> str:
        raise ValueError("sessions pin a conversation's KV on one engine; a prefill/decode "
                         "pair does not serve them")

    def close_session(self, session_id: str) -> bool:
        return False

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, *, weight_version: str | None = None,
                                   pause_mode: str = "retract", commit: bool | None = None,
                                   model: str | None = None) -> dict:
        return self.update_weights_from_serialized(
            [serialize_named_tensors(named_tensors)], load_format, flush_cache,
            weight_version=weight_version, pause_mode=pause_mode, commit=commit, model=model)


def _listed(out: dict | list[dict]) -> list[dict]:
    return out if isinstance(out, list) else [out]


def _drop(first: dict | None, prefiller: Any) -> None:
    """A handoff no decode engine will take: its prefill engine forgets it (its shm file, its
    kept payload), if that engine still answers."""
    if first is not None and prefiller is not None:
        with contextlib.suppress(Exception):
            prefiller.drop_kv_handoff(first["meta_info"]["kv_handoff"]["id"])


def _continues(first: dict) -> bool:
    """Whether the prefill's sample goes on (else its one token ended it, and the decode
    engine's final event carries it)."""
    return first["meta_info"]["finish_reason"]["type"] == "handoff"


def _first_event(first: dict) -> dict:
    """The stream event of the first token (its text comes with the decode engine's)."""
    meta = {k: v for k, v in first["meta_info"].items() if k != "kv_handoff"}
    meta["finish_reason"] = None
    return {"text": "", "output_ids": list(first["output_ids"]), "meta_info": meta}


async def _async_events(events: Iterator[dict]) -> AsyncIterator[dict]:
    while True:
        event = await asyncio.to_thread(next, events, _END)
        if event is _END:
            return
        yield event

