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
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from hotswap.engine.client.protocol import STAGING_MODES
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
    CloseSessionRequest,
    CompletionRequest,
    GenerateBody,
    OpenSessionRequest,
)
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
ROUTERS = (open_routes, inference, sglang_routes, *CONTROL_ROUTERS)


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
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               served_model_name: str | None = None, tool_call_parser: str = "auto",
               reasoning_parser: str = "auto") -> FastAPI:
    """The server's ASGI app around `engine` (an Engine; the caller owns its lifetime)."""
    app = FastAPI(title="hotswap", summary="Rollout engine with live weight updates")
    name = served_model_name or engine.config.model_path.rstrip("/").rsplit("/", 1)[-1]
    app.state.hotswap = state = ServerState(engine, name, tool_call_parser, reasoning_parser)
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
    p.add_argument("--served-model-name", default=None)
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
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", default="auto")
    e.add_argument("--device", default="auto")
    e.add_argument("--max-total-tokens", type=int, default=None)
    e.add_argument("--page-size", type=int, default=1)
    e.add_argument("--max-running-requests", type=int, default=256)
    e.add_argument("--chunked-prefill-size", type=int, default=2048)
    e.add_argument("--max-prefill-tokens", type=int, default=8192)
    e.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs"])
    e.add_argument("--attention-backend", default="auto")
    e.add_argument("--disable-prefix-cache", action="store_true")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--deterministic", action="store_true")
    e.add_argument("--speculative", default=None, choices=["ngram", "self"],
                   help="speculative decoding: n-gram drafts or the policy's own first layers")
    e.add_argument("--speculative-num-draft-tokens", type=int, default=8,
                   help="the longest draft of a step (the length is chosen by measurement)")
    e.add_argument("--speculative-self-layers", type=int, default=None,
                   help="layers of the self-draft (default: calibrated)")
    e.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                   help="prefill/decode disaggregation (docs/fleet.md#prefill-and-decode)")
    e.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks (worker processes started by the server; each "
                        "joins a trainer's weight-update group itself)")
    e.add_argument("--mem-fraction", type=float, default=0.3)
    e.add_argument("--context-length", type=int, default=None)
    e.add_argument("--weight-update-timeout-s", type=float, default=300.0)
    e.add_argument("--no-pack-weights", action="store_true",
                   help="CPU float32: no oneDNN-blocked weight copies (half the weight memory)")
    e.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="keep a host copy of the weights across release_memory_occupation")
    e.add_argument("--no-check-weights-finite", action="store_true",
                   help="skip the NaN/inf check of weight updates (saves one pass over the data)")
    e.add_argument("--weight-staging", default="standby", choices=STAGING_MODES,
                   help="where a distributed update lands unless the call says: standby (one "
                        "extra copy of the weights; a bad tensor is refused before any write) "
                        "or none (in place; a bad tensor stops generation until a complete "
                        "update)")
    e.add_argument("--quantization", default=None, choices=["int8"],
                   help="int8: linear layers as int8 weights x int8 activations (CPU); the "
                        "trainer keeps sending full-precision weights, re-quantized per update")
    e.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization int8: the lm_head too (faster, larger logprob error)")
    e.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE models: requests may ask for the experts each token was routed "
                        "to (return_routed_experts; base64 arrays in meta_info)")
    add_hicache_args(p)
    return p


def add_hicache_args(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("hierarchical KV cache (HiCache)")
    h.add_argument("--enable-hierarchical-cache", action="store_true",
                   help="write evicted prefix KV to a host tier and load it back on a match")
    h.add_argument("--hicache-ratio", type=float, default=2.0,
                   help="host tier size as a multiple of the device KV pool")
    h.add_argument("--hicache-host-tokens", type=int, default=None,
                   help="host tier size in tokens (overrides --hicache-ratio)")
    h.add_argument("--hicache-storage-dir", default=None,
                   help="folder of prefix KV files shared by engine processes on this machine")
    h.add_argument("--hicache-write-policy", default="write_back",
                   choices=["write_back", "write_through"],
                   help="write_through: also write a request's prefix down when it leaves the "
                        "batch, not only when the device evicts it")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(model_path=args.model_path, dtype=args.dtype, device=args.device,
                max_total_tokens=args.max_total_tokens, page_size=args.page_size,
                max_running_requests=args.max_running_requests,
                chunked_prefill_size=args.chunked_prefill_size,
                max_prefill_tokens=args.max_prefill_tokens,
                schedule_policy=args.schedule_policy, attention_backend=args.attention_backend,
                enable_prefix_cache=not args.disable_prefix_cache, seed=args.seed,
                deterministic=args.deterministic, tp_size=args.tp_size,
                speculative=args.speculative,
                speculative_num_draft_tokens=args.speculative_num_draft_tokens,
                speculative_self_layers=args.speculative_self_layers,
                mem_fraction=args.mem_fraction,
                context_length=args.context_length,
                weight_update_timeout_s=args.weight_update_timeout_s,
                pack_weights=not args.no_pack_weights,
                enable_weights_cpu_backup=args.enable_weights_cpu_backup,
                check_weights_finite=not args.no_check_weights_finite,
                weight_staging=args.weight_staging,
                enable_hierarchical_cache=args.enable_hierarchical_cache,
                hicache_ratio=args.hicache_ratio, hicache_host_tokens=args.hicache_host_tokens,
                hicache_storage_dir=args.hicache_storage_dir,
                hicache_write_policy=args.hicache_write_policy,
                quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
                enable_return_routed_experts=args.enable_return_routed_experts,
                role=args.role)


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
                         args.served_model_name, args.tool_call_parser, args.reasoning_parser)
        logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)

