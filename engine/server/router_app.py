"""The Router's HTTP front: the servers' routes, passed through or fanned out.

- `/generate`, `/v1/completions`, `/v1/chat/completions`: proxied to the server the Router
  picks (prefix affinity, then load), streams included; `x-hotswap-server` names it.
- Weight updates (`/update_weights_from_disk`, `/update_weights_from_distributed`, and the
  process-group and two-phase routes): the Router's all-or-none methods.
- Other control routes (pause, continue, flush, abort, memory, LoRA, ...): sent to every server.
- Other GET routes (`/v1/models`, `/metrics`, ...): answered by one server.
Keys: the router checks the same api/admin keys as its servers and presents them to them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from hotswap.engine.errors import RemoteEngineError
from hotswap.engine.server.app import _install_error_handlers
from hotswap.engine.server.control_api import control_paths
from hotswap.engine.server.prepared_routes import (
    CommitRequest,
    PrepareFromDistributedRequest,
    prepared_routes,
)
from hotswap.engine.server.protocol import (
    GroupRequest,
    InitGroupRequest,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
)
from hotswap.engine.server.router import Router, affinity_key
from hotswap.engine.server.serving import GuardMiddleware, error_response, json_response

logger = logging.getLogger("hotswap.router")

INFERENCE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
# Owned by the Router's own methods (two phases, rank offsets); every other control route is
# sent to each server as it is.
_ROUTER_METHODS = frozenset({
    "/update_weights_from_disk", "/update_weights_from_distributed",
    "/init_weights_update_group", "/destroy_weights_update_group",
    "/prepare_weights_from_distributed", "/commit_weights_update", "/abort_weights_update"})
# Per-server state only a single server can answer: refused rather than answered by one.
_PER_SERVER = frozenset({"/get_weights_by_name", "/debug/check_integrity",
                         "/prepare_weights_from_disk"})
_CONTROL = control_paths() | {r.path for r in prepared_routes.routes} | {"/update_weight_version"}


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
        results = await asyncio.to_thread(router.fan_out, lambda e: e.health())
        failed = router.failures(results)
        if failed:
            return error_response(503, f"unhealthy servers: {failed}", "server_unavailable")
        return json_response({"status": "ok", "servers": len(router.urls)})

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        try:
            return json_response({"weight_version":
                                  await asyncio.to_thread(router.get_weight_version)})
        except RuntimeError as exc:
            return error_response(503, str(exc), "server_unavailable")

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        """One server's answer, with what a trainer's group must count for all of them."""
        try:
            ranks = await asyncio.to_thread(lambda: router.weight_sync_ranks)
            upstream = await clients[_least_loaded(router)].get("/get_server_info",
                                                                headers=headers(False))
        except (httpx.TransportError, RemoteEngineError) as exc:
            return error_response(502, f"a server is unreachable: {exc}", "server_unavailable")
        if upstream.status_code >= 400:
            return Response(upstream.content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type"))
        return json_response({**upstream.json(), "weight_sync_ranks": ranks,
                              "servers": router.urls})

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
        for _ in range(len(router.urls)):
            server = router.choose(key)
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

    for path in INFERENCE_PATHS:
        app.add_api_route(path, proxy, methods=["POST"])

    async def call(fn: Any, **kwargs: Any) -> Response:
        return json_response(await asyncio.to_thread(fn, **kwargs))

    @app.post("/update_weights_from_disk")
    async def update_from_disk(body: UpdateFromDiskRequest) -> Response:
        return await call(router.update_weights_from_disk, **body.model_dump())

    @app.post("/init_weights_update_group")
    async def init_group(body: InitGroupRequest) -> Response:
        return await call(router.init_weights_update_group, **body.model_dump())

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(body: UpdateFromDistributedRequest) -> Response:
        return await call(router.update_weights_from_distributed, **body.model_dump())

    @app.post("/destroy_weights_update_group")
    async def destroy_group(body: GroupRequest | None = None) -> Response:
        return await call(router.destroy_weights_update_group,
                          **(body or GroupRequest()).model_dump())

    @app.post("/prepare_weights_from_distributed")
    async def prepare(body: PrepareFromDistributedRequest) -> Response:
        return await call(router.prepare_weights_from_distributed, **body.model_dump())

    @app.post("/commit_weights_update")
    async def commit(body: CommitRequest | None = None) -> Response:
        return await call(router.commit_weights_update, **(body or CommitRequest()).model_dump())

    @app.post("/abort_weights_update")
    async def abort() -> Response:
        return await call(router.abort_weights_update)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def passthrough(path: str, request: Request) -> Response:
        path = "/" + path
        if path in _PER_SERVER:
            return error_response(400, f"{path} describes one server: ask it directly "
                                  f"({', '.join(router.urls)})", "invalid_request_error")
        if request.method == "GET":
            return await _forward(clients[_least_loaded(router)], request, headers(False))
        if path not in _CONTROL:
            return error_response(404, f"no route {path}", "not_found_error")
        answers = await asyncio.gather(*(_forward(c, request, headers(True)) for c in clients))
        return _merge(router, answers)

    _install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=router.api_key, admin_key=router.admin_key,
                       max_body_bytes=max_body_bytes, count=lambda route, status: None,
                       routes=set(), control_paths=_CONTROL)
    return app


async def _relay(upstream: httpx.Response, done: Any) -> AsyncIterator[bytes]:
    """The server's bytes as they come; closing (a client that left) closes the upstream
    request, so the server aborts it and frees its KV."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()
        done()


async def _forward(client: httpx.AsyncClient, request: Request,
                   headers: dict[str, str]) -> Response:
    try:
        upstream = await client.request(request.method, request.url.path,
                                        params=request.query_params,
                                        content=await request.body(), headers=headers)
    except httpx.TransportError as exc:
        return error_response(502, f"{client.base_url} unreachable: {exc}", "server_unavailable")
    return Response(upstream.content, status_code=upstream.status_code,
                    media_type=upstream.headers.get("content-type"))


def _merge(router: Router, answers: list[Response]) -> Response:
    """Every server's answer to one control call: the first error as it is, else the replies."""
    for answer in answers:
        if answer.status_code >= 400:
            return answer
    replies = {url: json.loads(a.body) for url, a in zip(router.urls, answers, strict=True)}
    success = all(not isinstance(r, dict) or r.get("success", True) for r in replies.values())
    return json_response({"success": success, "message": f"{len(replies)} servers answered",
                          "servers": replies})


def _least_loaded(router: Router) -> int:
    return min(range(len(router.urls)), key=lambda i: (router.inflight[i], i))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hotswap.engine.server.router",
                                description="Route requests over several hotswap servers.")
    p.add_argument("--urls", nargs="+", required=True, help="the servers' base URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--api-key", default=None, help="the servers' API key (or HOTSWAP_API_KEY)")
    p.add_argument("--admin-key", default=None,
                   help="the servers' admin key (or HOTSWAP_ADMIN_KEY)")
    p.add_argument("--cache-threshold", type=float, default=0.5)
    p.add_argument("--balance-abs", type=int, default=16)
    p.add_argument("--balance-rel", type=float, default=2.0)
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    router = Router(args.urls, args.api_key or os.environ.get("HOTSWAP_API_KEY") or None,
                    args.admin_key or os.environ.get("HOTSWAP_ADMIN_KEY") or None,
                    cache_threshold=args.cache_threshold, balance_abs=args.balance_abs,
                    balance_rel=args.balance_rel)
    logger.info("routing over %s on http://%s:%d", ", ".join(router.urls), args.host, args.port)
    with router:
        uvicorn.run(router.app(), host=args.host, port=args.port, log_level=args.log_level)
