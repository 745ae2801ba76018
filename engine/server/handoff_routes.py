"""Routes of the prefill/decode handoff (docs/fleet.md#prefill-and-decode).

`/prefill` and `/generate_from_handoff` are Engine.prefill and Engine.generate_from_handoff; the
KV travels beside the request (a shm file or the KV transfer group), never in the JSON. The KV
transfer group's routes need the admin key. None of these is in the server's route table: a
data-parallel Router has nothing to do with them; a PDRouter calls each engine itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import Field
from starlette.responses import Response

from hotswap.engine.client.protocol import decode_outputs
from hotswap.engine.server.protocol import Body, Int, Port, request_body
from hotswap.engine.server.serving import SSEResponse, State, blocking

handoff_routes = APIRouter()
handoff_control = APIRouter()
_END = object()


# "auto" is "shm" over HTTP: "inline" holds a tensor, for engines of one process only
PrefillRequest = request_body("PrefillRequest", drop=("stream", "session_id"), transport=(
    Literal["auto", "shm", "group"], "auto"))
FromHandoffRequest = request_body(
    "FromHandoffRequest", drop=("prompt", "input_ids", "messages", "session_id"),
    handoff=(dict[str, Any], ...))


class KVGroupRequest(Body):
    master_address: str
    master_port: Port
    rank: Int = Field(ge=0)
    world_size: Int = Field(ge=2)
    group_name: str = "kv_transfer"
    backend: Literal["auto", "gloo", "nccl"] = "auto"


class SendHandoffRequest(Body):
    handoff_id: str
    dst_rank: Int = Field(ge=0)


class DropHandoffRequest(Body):
    handoff_id: str


@handoff_routes.post("/prefill")
async def prefill(state: State, body: PrefillRequest) -> Response:
    kwargs = body.model_dump()
    kwargs["transport"] = "shm" if kwargs["transport"] == "auto" else kwargs["transport"]
    return await blocking(state.engine.prefill, **kwargs)


@handoff_routes.post("/generate_from_handoff")
async def generate_from_handoff(state: State, body: FromHandoffRequest) -> Response:
    kwargs = body.model_dump()
    kwargs["handoff"] = decode_outputs(kwargs["handoff"])
    if not kwargs["stream"]:
        return await blocking(state.engine.generate_from_handoff, **kwargs)
    events = await asyncio.to_thread(lambda: state.engine.generate_from_handoff(**kwargs))
    return SSEResponse(_async_events(events))


async def _async_events(events: Iterator[dict]) -> AsyncIterator[dict]:
    try:
        while True:
            event = await asyncio.to_thread(next, events, _END)
            if event is _END:
                return
            yield event
    finally:
        events.close()  # a client that left aborts the requests


@handoff_control.post("/init_kv_transfer_group")
async def init_kv_transfer_group(state: State, body: KVGroupRequest) -> Response:
    return await blocking(state.engine.init_kv_transfer_group, **body.model_dump())


@handoff_control.post("/send_kv_handoff")
async def send_kv_handoff(state: State, body: SendHandoffRequest) -> Response:
    return await blocking(state.engine.send_kv_handoff, **body.model_dump())


@handoff_control.post("/drop_kv_handoff")
async def drop_kv_handoff(state: State, body: DropHandoffRequest) -> Response:
    return await blocking(lambda: {"success": state.engine.drop_kv_handoff(body.handoff_id)})


@handoff_control.post("/destroy_kv_transfer_group")
async def destroy_kv_transfer_group(state: State) -> Response:
    return await blocking(state.engine.destroy_kv_transfer_group)


def handoff_control_paths() -> frozenset[str]:
    return frozenset(r.path for r in handoff_control.routes)
