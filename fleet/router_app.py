"""The Router's HTTP front, built from the server's own route table (engine/server/app.py).

- Inference (`/generate`, the OpenAI routes, the scoring routes): proxied to a server of the
  model the body names ("model"; none: the policy) that the Router picks (prefix affinity, then
  load), streams included; `x-hotswap-server` names it.
- Control routes whose meaning spans servers (updates, groups, two phases, reads that must
  agree): the Router's methods, with the server's own request bodies.
- Every other control route, GET or POST: sent to every server; the first error, or all replies.
- Other routes (`/v1/models`, `/metrics`, ...): answered by the least loaded server.
A route added to the server is reachable through the router without a change here. Keys: the
router checks the same api/admin keys as its servers and presents them to them.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from hotswap.engine.client.protocol import CLASSIFY_PATH
from hotswap.engine.errors import RemoteEngineError
from hotswap.engine.server.app import control_paths, install_error_handlers, route_table
from hotswap.engine.server.protocol import (
    CloseSessionRequest,
    GroupRequest,
    InitGroupRequest,
    OpenSessionRequest,
    PrepareFromDistributedRequest,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
    WeightsByNameRequest,
)
from hotswap.engine.server.serving import GuardMiddleware, error_response, json_response
from hotswap.engine.server.sglang_compat import (
    UpdateFromTensorRequest,
    UpdateWeightVersionRequest,
)
from hotswap.engine.server.update_routes import (
    CommitRequest,
    PrepareFromDiskRequest,
)
from hotswap.fleet.affinity import affinity_key
from hotswap.fleet.coordinator import ServersDisagree, failures
from hotswap.fleet.router import Router

logger = logging.getLogger("hotswap.router")

# Routed by the body's "model": exactly a served name on hotswap's own routes; on the others
# (OpenAI's, vLLM's, OpenRLHF's) "name:adapter" or an unknown name means the policy.
NATIVE_PATHS = frozenset({"/generate", CLASSIFY_PATH})
INFERENCE_PATHS = NATIVE_PATHS | {"/v1/completions", "/v1/chat/completions", "/classify",
                                  "/v1/classify", "/v1/embeddings", "/get_reward"}


def _owned(router: Router) -> dict[str, tuple[type[BaseModel] | None, bool, Callable[..., Any]]]:
    """path -> (body model, body optional, call): the control routes the Router answers itself."""
    def update_from_tensor(abort_all_requests: bool, **kwargs: Any) -> dict:
        if abort_all_requests:  # on the servers the update is for
            members = router.members()
            router.call_each(lambda e: e.abort_request(abort_all=True), [
                members[i] for i in router.servers_for(kwargs.get("model"), update=True)])
        return router.update_weights_from_serialized(**kwargs)

    def check_integrity() -> dict:
        try:
            router.check_integrity()
        except AssertionError as exc:
            return {"success": False, "message": str(exc)}
        return {"success": True, "message": "ok"}

    return {
        "/update_weights_from_disk": (UpdateFromDiskRequest, False,
                                      router.update_weights_from_disk),
        "/update_weights_from_tensor": (UpdateFromTensorRequest, False, update_from_tensor),
        "/update_weight_version": (UpdateWeightVersionRequest, False,
                                   router.update_weight_version),
        "/init_weights_update_group": (InitGroupRequest, False, router.init_weights_update_group),
        "/update_weights_from_distributed": (UpdateFromDistributedRequest, False,
                                             router.update_weights_from_distributed),
        "/destroy_weights_update_group": (GroupRequest, True,
                                          router.destroy_weights_update_group),
        "/prepare_weights_from_distributed": (PrepareFromDistributedRequest, False,
                                              router.prepare_weights_from_distributed),
        "/prepare_weights_from_disk": (PrepareFromDiskRequest, False,
                                       router.prepare_weights_from_disk),
        "/commit_weight_update": (CommitRequest, True, router.commit_weight_update),
        "/abort_weight_update": (None, True, router.abort_weight_update),
        "/get_weights_by_name": (WeightsByNameRequest, False, router.get_weights_by_name),
        "/debug/check_integrity": (None, True, check_integrity),
    }


def create_router_app(router: Router, max_body_bytes: int = 32 << 20) -> FastAPI:
    clients: list[httpx.AsyncClient] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        clients.extend(httpx.AsyncClient(base_url=u, timeout=httpx.Timeout(None, connect=10.0))
                       for u in router.urls)
        yield
        for client in clients:
            await client.aclose()

    app = FastAPI(title="hotswap router", lifespan=lifespan)

    def headers(admin: bool) -> dict[str, str]:
        return router.headers(admin) | {"content-type": "application/json"}

    @app.get("/health")
    async def health() -> Response:
        results = await asyncio.to_thread(router.call_each, lambda e: e.health())
        failed = failures(results)
        if failed:
            return error_response(503, f"unhealthy servers: {failed}", "server_unavailable")
        return json_response({"status": "ok", "servers": len(router.urls)})

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return json_response({"weight_version":
                              await asyncio.to_thread(router.get_weight_version)})

    @app.get("/list_lora_adapters")
    async def list_lora_adapters() -> Response:
        return json_response(await asyncio.to_thread(router.list_lora_adapters))

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        """A policy server's answer, with what a trainer's group must count for all of them
        and every model served behind the router."""
        try:
            ranks = await asyncio.to_thread(lambda: router.weight_sync_ranks)
            models = await asyncio.to_thread(lambda: router.served_models)
            policy = router.least_loaded(router.servers_for(None))
            upstream = await clients[policy].get("/get_server_info", headers=headers(False))
        except (httpx.TransportError, RemoteEngineError) as exc:
            return error_response(502, f"a server is unreachable: {exc}", "server_unavailable")
        if upstream.status_code >= 400:
            return _relayed(upstream)
        return json_response({**upstream.json(), "weight_sync_ranks": ranks,
                              "servers": router.urls, "models": {
                                  name: {"frozen": m["frozen"],
                                         "servers": [router.urls[i] for i in m["servers"]]}
                                  for name, m in models.items()}})

    @app.get("/v1/models")
    async def list_models() -> Response:
        """Every model behind the router (with its adapters), from one server of each."""
        models = await asyncio.to_thread(lambda: router.served_models)
        answers = await asyncio.gather(*(clients[m["servers"][0]].get(
            "/v1/models", headers=headers(False)) for m in models.values()))
        for answer in answers:
            if answer.status_code >= 400:
                return _relayed(answer)
        return json_response({"object": "list",
                              "data": [m for a in answers for m in a.json()["data"]]})

    @app.post("/open_session")
    async def open_session(body: OpenSessionRequest) -> Response:
        session = await asyncio.to_thread(router.open_session, body.ttl_s, body.session_id)
        return json_response({"session_id": session})

    @app.post("/close_session")
    async def close_session(body: CloseSessionRequest) -> Response:
        if not await asyncio.to_thread(router.close_session, body.session_id):
            return error_response(404, f"session_id {body.session_id!r}: no such session is "
                                  "open", "not_found_error")
        return json_response({"success": True})

    async def proxy(request: Request) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError as exc:
            raise ValueError(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise ValueError("request body must be a JSON object")
        path = request.url.path
        key = affinity_key(path, payload)
        among = await asyncio.to_thread(router.servers_for, payload.get("model"), False,
                                        path not in NATIVE_PATHS)
        held = router.session_server(payload["session_id"]) if payload.get(
            "session_id") is not None else None
        for _ in range(len(among)):
            server = router.choose(key, held, among)
            try:
                upstream = await clients[server].send(clients[server].build_request(
                    "POST", path, content=body, headers=headers(False)), stream=True)
            except httpx.TransportError as exc:
                router.done(server)
                router.mark_down(server)
                logger.warning("server %s unreachable: %s", router.urls[server], exc)
                continue
            return StreamingResponse(
                _relay(upstream, lambda s=server: router.done(s)),
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type"),
                headers={"x-hotswap-server": router.urls[server]})
        return error_response(502, "no server reachable", "server_unavailable")

    async def to_all(request: Request) -> Response:
        answers = await asyncio.gather(*(_forward(c, request, headers(True)) for c in clients))
        return _merge(router, answers)

    async def to_one(request: Request) -> Response:
        return await _forward(clients[router.least_loaded()], request, headers(False))

    owned = _owned(router)
    taken = {(method, r.path) for r in app.routes for method in getattr(r, "methods", ())}
    # The scoring routes are proxied even where the servers' table lacks them (their 404).
    table = set(route_table()) | {("POST", path, False) for path in INFERENCE_PATHS}
    for method, path, is_control in sorted(table):
        if (method, path) in taken:
            continue
        if path in INFERENCE_PATHS:
            endpoint = proxy
        elif is_control and path in owned:
            endpoint = _owned_endpoint(*owned[path])
        else:
            endpoint = to_all if is_control else to_one
        app.add_api_route(path, endpoint, methods=[method])

    install_error_handlers(app)

    async def disagree(_: Request, exc: Exception) -> Response:
        return error_response(503, str(exc), "server_unavailable")

    app.add_exception_handler(ServersDisagree, disagree)
    app.add_middleware(GuardMiddleware, api_key=router.api_key, admin_key=router.admin_key,
                       max_body_bytes=max_body_bytes, count=lambda route, status: None,
                       routes=set(), control_paths=control_paths())
    return app


def _owned_endpoint(model: type[BaseModel] | None, optional: bool,
                    call: Callable[..., Any]) -> Callable[..., Any]:
    """An endpoint that parses the server's body model (same 400s as the server) and runs the
    Router's method in a worker thread (it blocks on every server)."""
    async def endpoint(body: Any = None) -> Response:
        kwargs = {} if body is None else body.model_dump()
        if body is None and model is not None:
            kwargs = model().model_dump()
        return json_response(await asyncio.to_thread(call, **kwargs))

    params = [] if model is None else [inspect.Parameter(
        "body", inspect.Parameter.KEYWORD_ONLY, annotation=model | None if optional else model,
        default=None if optional else inspect.Parameter.empty)]
    endpoint.__signature__ = inspect.Signature(params, return_annotation=Response)
    return endpoint


async def _relay(upstream: httpx.Response, done: Any) -> AsyncIterator[bytes]:
    """The server's bytes as they come; closing (a client that left) closes the upstream
    request, so the server aborts it and frees its KV."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()
        done()


def _relayed(upstream: httpx.Response) -> Response:
    return Response(upstream.content, status_code=upstream.status_code,
                    media_type=upstream.headers.get("content-type"))


async def _forward(client: httpx.AsyncClient, request: Request,
                   headers: dict[str, str]) -> Response:
    try:
        upstream = await client.request(request.method, request.url.path,
                                        params=request.query_params,
                                        content=await request.body(), headers=headers)
    except httpx.TransportError as exc:
        return error_response(502, f"{client.base_url} unreachable: {exc}", "server_unavailable")
    return _relayed(upstream)


def _merge(router: Router, answers: list[Response]) -> Response:
    """Every server's answer to one control call: the first error as it is, else the replies."""
    for answer in answers:
        if answer.status_code >= 400:
            return answer
    replies = {url: json.loads(a.body) for url, a in zip(router.urls, answers, strict=True)}
    success = all(not isinstance(r, dict) or r.get("success", True) for r in replies.values())
    return json_response({"success": success, "message": f"{len(replies)} servers answered",
                          "servers": replies})
