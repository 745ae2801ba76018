"""What the HTTP routes share: the server state, JSON bodies, SSE streams, and disconnects."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, suppress
from functools import lru_cache
from typing import Annotated, Any

import anyio
import numpy as np
from fastapi import Depends, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotswap.engine.client.protocol import routes_to_json
from hotswap.engine.parsers import (
    detect_reasoning_parser,
    detect_tool_parser,
    tool_parser,
)
from hotswap.engine.parsers import reasoning_parser as parsers_reasoning
from hotswap.engine.server.metrics import ServerMetrics
from hotswap.engine.server.openai_api import ChatSetup, Formatter

logger = logging.getLogger("hotswap.server")


class ServerState:
    def __init__(self, engine: Any, model_name: str, tool_call_parser: str = "auto",
                 reasoning_parser: str = "auto"):
        self.engine = engine
        self.model_name = model_name
        self.metrics = ServerMetrics(engine)
        self.chat = chat_setup(engine.tokenizer, tool_call_parser, reasoning_parser)
        self.formatter = Formatter(lru_cache(maxsize=1 << 16)(
            lambda t: engine.tokenizer.decode([t])), self.chat.memory)


def chat_setup(tokenizer: Any, tool_call_parser: str, reasoning_parser: str) -> ChatSetup:
    """The parsers by name; "auto": what the chat template's markup asks for (a template
    without tool markup gets hermes, the format the server then describes the tools in);
    "none": off. ValueError for an unknown name."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        template = None  # a dict of named templates: detection reads the default one only
    tools = None
    if tool_call_parser == "auto":
        tools = tool_parser(detect_tool_parser(template) or "hermes")
    elif tool_call_parser != "none":
        tools = tool_parser(tool_call_parser)
    reasoning = None
    if reasoning_parser == "auto":
        found = detect_reasoning_parser(template)
        reasoning = parsers_reasoning(*found) if found else None
    elif reasoning_parser != "none":
        found = detect_reasoning_parser(template)
        reasoning = parsers_reasoning(reasoning_parser, bool(found and found[1]))
    return ChatSetup(tokenizer, tools, reasoning)


def _state(request: Request) -> ServerState:
    return request.app.state.hotswap


State = Annotated[ServerState, Depends(_state)]


# Characters that str.splitlines() (and so httpx's aiter_lines) takes as line ends but that
# json.dumps(ensure_ascii=False) leaves raw: a model's text holding one would cut an SSE line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps(obj: Any) -> bytes:
    """One line of JSON, UTF-8: non-finite floats (a -inf logprob) replaced, since JSON has no
    infinity, and Unicode line separators escaped."""
    try:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                          default=_array)
    except ValueError:
        text = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"),
                          default=_array)
    return text.translate(_LINE_BREAKS).encode("utf-8", "replace")


def _array(obj: Any) -> Any:
    """Arrays in outputs (meta_info["routed_experts"]) go as base64 of their bytes."""
    if isinstance(obj, np.ndarray):
        return routes_to_json(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else (
            None if obj != obj else (-9999.0 if obj < 0 else 9999.0))
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def error_response(status: int, message: str, kind: str) -> Response:
    return json_response({"error": {"message": message, "type": kind, "code": status}}, status)


class SSEResponse(StreamingResponse):
    """A stream that ends (and closes its source, aborting the request) when the client leaves,
    whether or not a chunk is due: a queued or paused request sends nothing for a while."""

    def __init__(self, chunks: AsyncIterator[Any]):
        super().__init__(self._frames(chunks), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @staticmethod
    async def _frames(chunks: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    yield b"data: " + dumps(chunk) + b"\n\n"
        except Exception as exc:  # noqa: BLE001 - the status is sent; report in-band
            logger.exception("stream failed")
            yield b"data: " + dumps({"error": {"message": str(exc), "type": "internal_error"}})
            yield b"\n\n"
        yield b"data: [DONE]\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await self.stream_response(send)
            except OSError:
                pass  # the client left while a chunk was being sent
            finally:
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()
            group.cancel_scope.cancel()


CLIENT_GONE = object()


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or CLIENT_GONE when the client disconnects first: then `work` is
    cancelled, which aborts its requests and frees their KV."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return CLIENT_GONE


async def blocking(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Response:
    return json_response(await asyncio.to_thread(fn, *args, **kwargs))


# Probes and Prometheus scrapers carry no key (docs/api.md#keys).
OPEN_PATHS = frozenset({"/health", "/metrics"})


class GuardMiddleware:
    """Keys and the body size limit, both enforced before the app sees the request (a refused
    request changes nothing); and request counting by route for the metrics."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_key: str | None,
                 max_body_bytes: int, count: Callable[[str, int], None], routes: set[str],
                 control_paths: frozenset[str]):
        self.app = app
        self.api_key = api_key
        self.admin_key = admin_key
        self.max_body_bytes = max_body_bytes
        self.count = count
        self.routes = routes
        self.control_paths = control_paths

    def _keys_for(self, path: str) -> list[str]:
        if path in OPEN_PATHS:
            return []
        if path in self.control_paths:
            key = self.admin_key or self.api_key
            return [key] if key else []
        return [k for k in (self.api_key, self.admin_key) if k] if self.api_key else []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in self.routes else "other"
        status = [500]

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, counted_send)
        finally:
            self.count(route, status[0])

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope)
        body = None if refusal is not None else await self._read_body(receive)
        if refusal is None and body is None:
            refusal = self._too_large()
        if refusal is not None:
            await refusal(scope, receive, send)
        else:
            await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> Response:
        return error_response(400, f"request body exceeds {self.max_body_bytes} bytes",
                              "invalid_request_error")

    def _refusal(self, scope: Scope) -> Response | None:
        keys = self._keys_for(scope["path"])
        if keys and not _authorized(scope, keys):
            response = error_response(401, "missing or invalid key (Authorization: Bearer ...)",
                                      "authentication_error")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit():
            return error_response(400, "invalid Content-Length", "invalid_request_error")
        return self._too_large() if int(length) > self.max_body_bytes else None

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None when it is larger than the limit (chunked uploads)."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later: the disconnect, which streams watch for

    return replay


def _authorized(scope: Scope, keys: list[str]) -> bool:
    header = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = header.partition(b" ")
    # Compare with every key, always, so timing does not tell which (or whether one) matched.
    matches = [hmac.compare_digest(token.strip(), key.encode()) for key in keys]
    return scheme.lower() == b"bearer" and any(matches)
