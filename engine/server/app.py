"""The HTTP server: OpenAI-compatible and native generation, metrics, and the control plane.

`python -m hotswap.engine.server --model-path ... [--port 30000] [--api-key K] [--admin-key A]`.
`create_app(engine, ...)` builds the FastAPI app around an in-process Engine; routes never block
the event loop: generation awaits the engine's async API and the blocking control calls (weight
updates, pause, flush) run in worker threads, so streams keep flowing during a weight update.

Keys (Bearer): control routes need the admin key when one is set (the API key otherwise);
/health and /metrics are open (probes and scrapers carry no key); every other route needs the
API key when one is set (the admin key works too).
Both are checked before the body is read, with constant-time comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import time
import typing
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from hotswap.engine.client.protocol import CLASSIFY_PATH, STAGING_MODES
from hotswap.engine.config import EngineConfig
from hotswap.engine.errors import WeightsIncompleteError
from hotswap.engine.parsers import REASONING_PARSERS, TOOL_PARSERS
from hotswap.engine.server.control_api import control, lora_routes, memory_routes
from hotswap.engine.server.handoff_routes import (
    handoff_control,
    handoff_control_paths,
    handoff_routes,
)
from hotswap.engine.server.metrics import CONTENT_TYPE
from hotswap.engine.server.openai_api import Job, chat_job, completion_job, lora_for_model
from hotswap.engine.server.protocol import (
    ChatCompletionRequest,
    ClassifyBody,
    CloseSessionRequest,
    CompletionRequest,
    GenerateBody,
    OpenSessionRequest,
)
from hotswap.engine.server.scoring_routes import scoring_routes
from hotswap.engine.server.serving import (
    CLIENT_GONE,
    GuardMiddleware,
    ServerState,
    SSEResponse,
    State,
    error_response,
    json_response,
    until_disconnect,
)
from hotswap.engine.server.sglang_compat import (
    GenerateOptions,
    sglang_control,
    sglang_routes,
    shape_output,
    translate_generate,
)
from hotswap.engine.server.update_routes import update_routes

logger = logging.getLogger("hotswap.server")

DEFAULT_MAX_BODY_BYTES = 32 << 20

open_routes = APIRouter()
inference = APIRouter()
# Control routes need the admin key; a router in front of several servers sends each of them to
# every server (hotswap.fleet derives its fan-out from this table).
CONTROL_ROUTERS = (control, memory_routes, lora_routes, update_routes, sglang_control)
ROUTERS = (open_routes, inference, sglang_routes, scoring_routes, *CONTROL_ROUTERS)


def control_paths() -> frozenset[str]:
    return frozenset(r.path for router in CONTROL_ROUTERS for r in router.routes)


def route_table() -> list[tuple[str, str, bool]]:
    """(method, path, is_control) for every route of the server."""
    control_set = control_paths()
    return sorted((method, r.path, r.path in control_set) for router in ROUTERS
                  for r in router.routes for method in r.methods)


@open_routes.get("/health")
async def health(state: State) -> Response:
    incomplete = state.engine.weights.incomplete
    if incomplete is not None:
        return error_response(503, incomplete, "weights_incomplete")
    return json_response({"status": "ok"})


@inference.get("/get_weight_version")
async def get_weight_version(state: State) -> Response:
    return json_response({"weight_version": state.engine.get_weight_version()})


@open_routes.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@inference.get("/v1/models")
async def list_models(state: State) -> Response:
    return json_response({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": 0, "owned_by": "hotswap",
         "root": state.engine.config.model_path,
         "max_model_len": state.engine.config.context_length}] + [
        {"id": f"{state.model_name}:{name}", "object": "model", "created": 0,
         "owned_by": "hotswap", "parent": state.model_name}
        for name in state.engine.list_lora_adapters()]})


@inference.get("/list_lora_adapters")
async def list_lora_adapters(state: State) -> Response:
    return json_response(state.engine.list_lora_adapters())


@inference.post("/open_session")
async def open_session(state: State, body: OpenSessionRequest) -> Response:
    session = await asyncio.to_thread(state.engine.open_session, body.ttl_s, body.session_id)
    return json_response({"session_id": session})


@inference.post("/close_session")
async def close_session(state: State, body: CloseSessionRequest) -> Response:
    if not await asyncio.to_thread(state.engine.close_session, body.session_id):
        raise HTTPException(404, f"session_id {body.session_id!r}: no such session is open")
    return json_response({"success": True})


@inference.post("/generate")
async def generate(state: State, body: GenerateBody, request: Request) -> Response:
    kwargs, options = translate_generate(body)
    stream = kwargs.pop("stream", False)
    decode = state.engine.tokenizer.decode
    if stream:
        events = await state.engine.async_generate(**kwargs, stream=True)
        return SSEResponse(_shaped(_observed(state, events), options, decode))
    out = await until_disconnect(request, state.engine.async_generate(**kwargs))
    if out is CLIENT_GONE:
        return Response(status_code=499)
    for o in out if isinstance(out, list) else [out]:
        state.metrics.observe_output(o["meta_info"])
        shape_output(o, options, lambda t: decode([t]))
    return json_response(out)


@inference.post(CLASSIFY_PATH)
async def classify(state: State, body: ClassifyBody, request: Request) -> Response:
    """Engine.classify over HTTP: its arguments in, its outputs back (RemoteEngine's route)."""
    out = await until_disconnect(request, state.engine.async_classify(
        **body.model_dump(exclude_unset=True)))
    if out is CLIENT_GONE:
        return Response(status_code=499)
    return json_response(out)


async def _shaped(events: AsyncIterator[dict], options: GenerateOptions,
                  decode: Any) -> AsyncIterator[dict]:
    async with aclosing(events):
        async for event in events:
            yield shape_output(event, options, lambda t: decode([t]))


async def _observed(state: ServerState, events: AsyncIterator[dict]) -> AsyncIterator[dict]:
    start = time.perf_counter()
    first = True
    async with aclosing(events):
        async for event in events:
            if first and event["output_ids"]:
                state.metrics.ttft.observe(time.perf_counter() - start)
                first = False
            if event["meta_info"]["finish_reason"] is not None:
                state.metrics.observe_output(event["meta_info"])
            yield event


@inference.post("/v1/completions")
async def completions(state: State, body: CompletionRequest, request: Request) -> Response:
    return await _serve_openai(state, request, completion_job(body, state.model_name),
                               body.stream)


@inference.post("/v1/chat/completions")
async def chat_completions(state: State, body: ChatCompletionRequest, request: Request) -> Response:
    job = chat_job(body, state.model_name, state.engine.config.context_length, state.chat)
    return await _serve_openai(state, request, job, body.stream)


async def _serve_openai(state: ServerState, request: Request, job: Job, stream: bool) -> Response:
    engine = state.engine
    lora = lora_for_model(job.model, state.model_name, engine.list_lora_adapters())
    if lora is not None:
        job.engine_kwargs["lora_name"] = lora
    if stream:
        events = await engine.async_generate(**job.engine_kwargs, stream=True)
        return SSEResponse(state.formatter.stream(job, _observed(state, events)))
    outs = await until_disconnect(request, engine.async_generate(**job.engine_kwargs))
    if outs is CLIENT_GONE:
        return Response(status_code=499)
    outs = outs if isinstance(outs, list) else [outs]
    for out in outs:
        state.metrics.observe_output(out["meta_info"])
    return json_response(state.formatter.response(job, outs))


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}"
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where or 'body'}: {message}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    async def invalid(_: Request, exc: Exception) -> Response:
        message = (_validation_message(exc) if isinstance(exc, RequestValidationError)
                   else str(exc))
        return error_response(400, message, "invalid_request_error")

    async def http_error(_: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    async def unavailable(_: Request, exc: Exception) -> Response:
        return error_response(503, str(exc), "weights_incomplete")

    async def internal(_: Request, exc: Exception) -> Response:
        logger.exception("internal error", exc_info=exc)
        return error_response(500, f"internal error: {exc!r}", "internal_error")

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(ValueError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(WeightsIncompleteError, unavailable)
    app.add_exception_handler(Exception, internal)


def create_app(engine: Any, api_key: str | None = None, admin_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tool_call_parser: str = "auto",
               reasoning_parser: str = "auto") -> FastAPI:
    """The server's ASGI app around `engine` (an Engine; the caller owns its lifetime). It
    serves the engine's model_name (EngineConfig.served_model_name)."""
    app = FastAPI(title="hotswap", summary="Rollout engine with live weight updates")
    app.state.hotswap = state = ServerState(engine, engine.model_name, tool_call_parser,
                                            reasoning_parser)
    for router in (*ROUTERS, handoff_routes, handoff_control):
        app.include_router(router)
    install_error_handlers(app)
    # Metrics label requests by route; any other path counts as "other".
    routes = {path for _, path, _ in route_table()}
    routes |= {r.path for r in handoff_routes.routes} | handoff_control_paths()
    app.add_middleware(GuardMiddleware, api_key=api_key, admin_key=admin_key,
                       max_body_bytes=max_body_bytes,
                       count=lambda route, status: state.metrics.requests.labels(
                           route, str(status)).inc(), routes=routes,
                       control_paths=control_paths() | handoff_control_paths())
    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hotswap.engine.server",
                                description="Serve a hotswap Engine over HTTP.")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; open it wider only with keys)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="Bearer key for inference routes "
                   "(or set HOTSWAP_API_KEY)")
    p.add_argument("--admin-key", default=None, help="Bearer key for control routes "
                   "(or set HOTSWAP_ADMIN_KEY)")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", "none", *sorted(TOOL_PARSERS)],
                   help="how chat outputs' tool calls are read (auto: from the chat template's "
                        "markup, hermes for a template without any)")
    p.add_argument("--reasoning-parser", default="auto",
                   choices=["auto", "none", *sorted(REASONING_PARSERS)],
                   help="how chat outputs' reasoning is split off (auto: think when the chat "
                        "template knows <think>, else none)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--log-level", default="info")
    add_engine_args(p.add_argument_group("engine", "EngineConfig's fields, one flag each"))
    return p


# Choices the config does not state itself (they live beside the code that checks them).
_CHOICES = {"weight_staging": STAGING_MODES}


def add_engine_args(group: argparse._ArgumentGroup) -> None:
    """One flag per EngineConfig field but model_path: `--page-size` for page_size, with its
    type, default, help and choices; a bool as `--name` / `--no-name`."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model_path":
            continue
        flag = "--" + f.name.replace("_", "-")
        text = f.metadata.get("help")
        kind = _flag_type(f.name, hints[f.name])
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                               help=text)
            continue
        choices = f.metadata.get("choices") or _CHOICES.get(f.name)
        group.add_argument(flag, type=kind, default=f.default, help=text,
                           choices=list(choices) if choices else None)
    # The server's spelling before its flags came from the config.
    group.add_argument("--disable-prefix-cache", dest="enable_prefix_cache",
                       action="store_false", help="the same as --no-enable-prefix-cache")


def _flag_type(name: str, hint: Any) -> type:
    """str, int, float or bool, from `T` or `T | None`."""
    kinds = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    if len(kinds) != 1 or kinds[0] not in (str, int, float, bool):
        raise TypeError(f"EngineConfig.{name}: a {hint} field has no server flag; give it "
                        "one in engine/server/app.py")
    return kinds[0]


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine's keyword arguments: every EngineConfig field from its flag."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def _log_exposure(host: str, api_key: str | None, admin_key: str | None) -> None:
    local = host in ("127.0.0.1", "localhost", "::1")
    if not (api_key or admin_key):
        logger.warning("no --api-key or --admin-key: every route, the control plane included, "
                       "is open to anyone who can reach %s%s", host,
                       " (this machine only)" if local else " - this address is NOT local")
    elif not admin_key:
        logger.warning("no --admin-key: control routes accept the API key")


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from hotswap.engine import Engine

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    api_key = args.api_key or os.environ.get("HOTSWAP_API_KEY") or None
    admin_key = args.admin_key or os.environ.get("HOTSWAP_ADMIN_KEY") or None
    _log_exposure(args.host, api_key, admin_key)
    with Engine(**engine_kwargs(args)) as engine:
        app = create_app(engine, api_key, admin_key, args.max_body_bytes,
                         args.tool_call_parser, args.reasoning_parser)
        logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)

