"""Router: several `python -m hotswap.engine.server` processes as one EngineClient.

Requests go where their longest prompt prefix was served (that server holds its KV), unless
that server is much busier than the least loaded one or the match is short; then the least
loaded server takes it. Control calls and weight updates are the Coordinator's: every server,
all or none (coordinator.py). docs/fleet.md#router says more.

Servers may serve different models (a policy and its reward model or judge): the Router asks
each its served name and whether it is frozen, and sends a request (generate, classify) to the
servers of the model it names (`model=`), or with none to the policy, the one model that is not
frozen; an update goes to the servers of the model it names, or to the policy's.

`create_router_app(router)` (router_app.py) is its HTTP front; `python -m hotswap.fleet` runs it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx

from hotswap.engine.client.remote import RemoteEngine
from hotswap.engine.client.request import ClassifyRequest, GenerateRequest
from hotswap.engine.errors import RemoteEngineError
from hotswap.fleet.affinity import Key, PrefixAffinity, affinity_key
from hotswap.fleet.coordinator import Coordinator, Member, ServersDisagree
from hotswap.weight_sync.serialize import serialize_named_tensors

_DOWN_FOR_S = 5.0  # a server that refused a connection is skipped this long


__all__ = ["Router", "ServersDisagree"]


class Router(Coordinator):
    def __init__(self, urls: Sequence[str], api_key: str | None = None,
                 admin_key: str | None = None, cache_threshold: float = 0.5,
                 balance_abs: int = 16, balance_rel: float = 2.0,
                 timeout_s: float | None = None):
        """cache_threshold: the matched share of a prompt that routes it to the server that
        has it; balance_abs / balance_rel: when the busiest server has that many more (and that
        many times as many) requests in flight as the idlest, routing ignores the cache."""
        super().__init__()
        if not urls or any(not isinstance(u, str) or not u for u in urls):
            raise ValueError("urls must be a non-empty list of server URLs")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError("urls repeats a server")
        self.api_key, self.admin_key = api_key, admin_key
        self.engines = [RemoteEngine(u, api_key, admin_key, timeout_s) for u in self.urls]
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.affinity = PrefixAffinity()
        self._sessions: dict[str, int] = {}  # session id -> the server holding it
        self.inflight = [0] * len(self.urls)
        self.assigned = [0] * len(self.urls)
        self._down_until = [0.0] * len(self.urls)
        self._lock = threading.Lock()
        # per server: (model name, frozen), asked once; None until the server answers
        self._served: list[tuple[str, bool] | None] = [None] * len(self.urls)

    def __repr__(self) -> str:
        return f"Router({self.urls!r})"

    def headers(self, admin: bool) -> dict[str, str]:
        """What this router presents to its servers (their keys are its keys)."""
        key = (self.admin_key or self.api_key) if admin else (self.api_key or self.admin_key)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def members(self) -> list[Member]:
        return list(zip(self.urls, self.engines, strict=True))

    # models: each server's, asked once

    @property
    def served_models(self) -> dict[str, dict[str, Any]]:
        """model name -> {"frozen", "servers" (indices)} of the servers that answered."""
        return self._models(every=False)

    def _models(self, every: bool) -> dict[str, dict[str, Any]]:
        """Servers unreachable so far are asked again (a down one after _DOWN_FOR_S) and left
        out meanwhile; `every`: an update's, which must know every server's model."""
        served = self._ask_models()
        missing = [self.urls[i] for i, s in enumerate(served) if s is None]
        if missing and (every or len(missing) == len(served)):
            raise RemoteEngineError(502, f"{', '.join(missing)}: unreachable, so the model "
                                    "it serves is unknown")
        models: dict[str, dict[str, Any]] = {}
        for i, known in enumerate(served):
            if known is None:
                continue
            name, frozen = known
            entry = models.setdefault(name, {"frozen": frozen, "servers": []})
            if entry["frozen"] != frozen:
                raise ValueError(f"model {name!r} is frozen on some servers and not on others")
            entry["servers"].append(i)
        return models

    def _ask_models(self) -> list[tuple[str, bool] | None]:
        with self._lock:
            served, down = list(self._served), list(self._down_until)
        now = time.monotonic()
        for i, engine in enumerate(self.engines):
            if served[i] is None and down[i] <= now:
                try:
                    served[i] = (engine.model_name, engine.frozen)
                except (httpx.TransportError, RemoteEngineError):
                    self.mark_down(i)
        with self._lock:
            self._served = served
        return served

    @property
    def model_name(self) -> str:
        """The policy's name: the one model its servers serve that is not frozen."""
        return self._default_model(update=True)

    def _default_model(self, update: bool) -> str:
        models = self._models(every=update)
        policies = sorted(n for n, m in models.items() if not m["frozen"])
        if len(policies) == 1:
            return policies[0]
        if not policies and len(models) == 1 and not update:
            return next(iter(models))
        which = (f"several models that are not frozen ({', '.join(policies)})" if policies
                 else f"only frozen models ({', '.join(sorted(models))})")
        raise ValueError(f"the servers serve {which}: name one with model=")

    def servers_for(self, model: str | None, update: bool = False,
                    openai: bool = False) -> list[int]:
        """The servers of `model` (None: the policy); ValueError for a model none serves.
        openai: the OpenAI routes' "model", where "name:adapter" names an adapter of `name`
        and any unknown name the policy (clients send placeholders)."""
        models = self._models(every=update)
        if openai and model not in models:
            base = model.rsplit(":", 1)[0] if isinstance(model, str) else None
            model = base if base in models else None
        if model is None:
            model = self._default_model(update)
        if model not in models:
            raise ValueError(f"model {model!r}: no server serves it (served: "
                             f"{', '.join(sorted(models))})")
        return models[model]["servers"]

    def _update_members(self, model: str | None) -> list[Member]:
        members = self.members()
        return [members[i] for i in self.servers_for(model, update=True)]

    def shutdown(self) -> None:
        """Closes the connections; the servers keep running."""
        for engine in self.engines:
            engine.shutdown()

    # routing

    def choose(self, key: Key, server: int | None = None,
               among: Sequence[int] | None = None) -> int:
        """The server for a prompt `key` among `among` (one model's servers; None: all), or
        the given one (a session's); counts it in flight until `done(server)`. Prefix
        affinity is per model: only matches on `among` count."""
        pool = list(range(len(self.urls))) if among is None else list(among)
        with self._lock:
            now = time.monotonic()
            up = [i for i in pool if self._down_until[i] <= now]
            candidates = up or pool
            if server is None:
                server = self._cached_choice(key, candidates)
            if server is None:
                server = min(candidates, key=lambda i: (self.inflight[i], self.assigned[i], i))
            self.inflight[server] += 1
            self.assigned[server] += 1
            self.affinity.insert(key, server)
            return server

    def _cached_choice(self, key: Key, candidates: list[int]) -> int | None:
        loads = [self.inflight[i] for i in candidates]
        if (max(loads) - min(loads) > self.balance_abs
                and max(loads) > self.balance_rel * min(loads)):
            return None  # imbalanced: spread the load first
        matches = {i: n for i, n in self.affinity.match(key).items() if i in candidates}
        if not matches or not key:
            return None
        server = max(matches, key=lambda i: (matches[i], -self.inflight[i]))
        return server if matches[server] / len(key) >= self.cache_threshold else None

    def done(self, server: int) -> None:
        with self._lock:
            self.inflight[server] -= 1

    def mark_down(self, server: int) -> None:
        with self._lock:
            self._down_until[server] = time.monotonic() + _DOWN_FOR_S

    def least_loaded(self, among: Sequence[int] | None = None) -> int:
        pool = range(len(self.urls)) if among is None else among
        with self._lock:
            return min(pool, key=lambda i: (self.inflight[i], i))

    # sessions: each stays on the policy's server that opened it

    def open_session(self, ttl_s: float = 300.0, session_id: str | None = None) -> str:
        server = self.least_loaded(self.servers_for(None))
        session = self.engines[server].open_session(ttl_s, session_id)
        with self._lock:
            self._sessions[session] = server
        return session

    def close_session(self, session_id: str) -> bool:
        with self._lock:
            server = self._sessions.pop(session_id, None)
        return server is not None and self.engines[server].close_session(session_id)

    def session_server(self, session_id: str | list[str | None]) -> int | None:
        """The server holding the call's session (None: no session given); ValueError for an
        unknown session or several."""
        ids = {session_id} if isinstance(session_id, str) else set(session_id) - {None}
        if len(ids) > 1:
            raise ValueError("session_id: one call's prompts go to one server; give one session")
        with self._lock:
            server = self._sessions.get(next(iter(ids))) if ids else None
        if ids and server is None:
            raise ValueError(f"session_id {next(iter(ids))!r}: no such session is open")
        return server

    # generation

    def _generate(self, request: GenerateRequest) -> dict | list[dict] | Iterator[dict]:
        server = self._server_for(request)
        try:
            out = self.engines[server].generate(**request.body())
        except BaseException:
            self.done(server)
            raise
        if request.stream:
            return self._counted(out, server)
        self.done(server)
        return out

    def _server_for(self, request: GenerateRequest) -> int:
        """A call's prompts go to one server: the session's, or the one chosen by the first
        prompt."""
        session = request.session_id
        server = self.session_server(session) if session is not None else None
        return self.choose(affinity_key("/generate", request.body()), server,
                           self.servers_for(request.model))

    def _counted(self, events: Iterator[dict], server: int) -> Iterator[dict]:
        try:
            yield from events
        finally:
            self.done(server)

    async def _async_generate(self, request: GenerateRequest
                              ) -> dict | list[dict] | AsyncIterator[dict]:
        server = self._server_for(request)
        try:
            out = await self.engines[server].async_generate(**request.body())
        except BaseException:
            self.done(server)
            raise
        if request.stream:
            return self._acounted(out, server)
        self.done(server)
        return out

    async def _acounted(self, events: AsyncIterator[dict], server: int) -> AsyncIterator[dict]:
        try:
            async for event in events:
                yield event
        finally:
            self.done(server)

    # scoring: a call's prompts go to one server, chosen by the first prompt like generate's

    def _classify(self, request: ClassifyRequest) -> dict | list[dict]:
        server = self.choose(affinity_key("/generate", request.body()), None,
                             self.servers_for(request.model))
        try:
            return self.engines[server].classify(**request.body())
        finally:
            self.done(server)

    async def _async_classify(self, request: ClassifyRequest) -> dict | list[dict]:
        server = self.choose(affinity_key("/generate", request.body()), None,
                             self.servers_for(request.model))
        try:
            return await self.engines[server].async_classify(**request.body())
        finally:
            self.done(server)

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, *, weight_version: str | None = None,
                                   pause_mode: str = "retract", commit: bool | None = None,
                                   model: str | None = None) -> dict:
        return self.update_weights_from_serialized(
            [serialize_named_tensors(named_tensors)], load_format, flush_cache,
            weight_version=weight_version, pause_mode=pause_mode, commit=commit, model=model)

