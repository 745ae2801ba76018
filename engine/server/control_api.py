"""The control plane: weight updates, process groups, pause/continue, flush, abort, debug.

Every engine call here may block (a weight update waits for its broadcast, a flush for running
requests to drain), so each runs in a worker thread and the event loop keeps serving streams.
Optional features (memory release, LoRA) have their own routers, included when the engine has
the methods.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

from hotswap.engine.server.protocol import (
    AbortRequest,
    FlushRequest,
    GroupRequest,
    InitGroupRequest,
    LoadLoraFromTensorsRequest,
    LoadLoraRequest,
    MemoryRequest,
    PauseRequest,
    UnloadLoraRequest,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
    WeightsByNameRequest,
)
from hotswap.engine.server.serving import ServerState, State, blocking, json_response
from hotswap.weight_sync.serialize import deserialize_named_tensors

control = APIRouter()
memory_routes = APIRouter()
lora_routes = APIRouter()


async def _update(state: ServerState, source: str, fn: Callable[..., dict],
                  **kwargs: Any) -> Response:
    start = time.perf_counter()
    result: dict | None = None
    try:
        result = await asyncio.to_thread(fn, **kwargs)
    finally:
        success = bool(result and result.get("success"))
        state.metrics.observe_update(source, time.perf_counter() - start, success)
    return json_response(result)


@control.post("/update_weights_from_disk")
async def update_weights_from_disk(state: State, body: UpdateFromDiskRequest) -> Response:
    return await _update(state, "disk", state.engine.update_weights_from_disk,
                         **body.model_dump())


@control.post("/init_weights_update_group")
async def init_weights_update_group(state: State, body: InitGroupRequest) -> Response:
    return await blocking(state.engine.init_weights_update_group, **body.model_dump())


@control.post("/update_weights_from_distributed")
async def update_weights_from_distributed(state: State,
                                          body: UpdateFromDistributedRequest) -> Response:
    return await _update(state, "distributed", state.engine.update_weights_from_distributed,
                         **body.model_dump())


@control.post("/destroy_weights_update_group")
async def destroy_weights_update_group(state: State, body: GroupRequest | None = None) -> Response:
    body = body or GroupRequest()
    return await blocking(state.engine.destroy_weights_update_group, body.group_name)


@control.post("/get_weights_by_name")
async def get_weights_by_name(state: State, body: WeightsByNameRequest) -> Response:
    return await blocking(state.engine.get_weights_by_name, body.name, body.truncate_size)


@control.post("/pause_generation")
async def pause_generation(state: State, body: PauseRequest | None = None) -> Response:
    return await blocking(state.engine.pause_generation, (body or PauseRequest()).mode)


@control.post("/continue_generation")
async def continue_generation(state: State) -> Response:
    return await blocking(state.engine.continue_generation)


@control.post("/flush_cache")
async def flush_cache(state: State, body: FlushRequest | None = None) -> Response:
    return await blocking(state.engine.flush_cache, (body or FlushRequest()).timeout_s)


@control.post("/abort_request")
async def abort_request(state: State, body: AbortRequest) -> Response:
    if body.rid is None and not body.abort_all:
        raise ValueError("give rid or abort_all: true")
    state.engine.abort_request(body.rid, body.abort_all)
    return json_response({"success": True, "message": "abort requested"})


@control.post("/debug/check_integrity")
async def check_integrity(state: State) -> Response:
    """Runs the engine's invariant checks (KV conservation, tree locks) between steps."""
    try:
        await asyncio.to_thread(state.engine.check_integrity)
    except AssertionError as exc:
        return json_response({"success": False, "message": f"integrity check failed: {exc}"})
    return json_response({"success": True, "message": "ok"})


@memory_routes.post("/release_memory_occupation")
async def release_memory_occupation(state: State, body: MemoryRequest | None = None) -> Response:
    return await blocking(state.engine.release_memory_occupation, (body or MemoryRequest()).tags)


@memory_routes.post("/resume_memory_occupation")
async def resume_memory_occupation(state: State, body: MemoryRequest | None = None) -> Response:
    return await blocking(state.engine.resume_memory_occupation, (body or MemoryRequest()).tags)


@lora_routes.post("/load_lora_adapter")
async def load_lora_adapter(state: State, body: LoadLoraRequest) -> Response:
    return await blocking(state.engine.load_lora_adapter, body.lora_name, body.lora_path,
                          pause_mode=body.pause_mode)


@lora_routes.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(state: State,
                                         body: LoadLoraFromTensorsRequest) -> Response:
    tensors = deserialize_named_tensors(body.serialized_tensors)
    return await blocking(state.engine.load_lora_adapter_from_tensors, body.lora_name, tensors,
                          body.config_dict, pause_mode=body.pause_mode)


@lora_routes.post("/unload_lora_adapter")
async def unload_lora_adapter(state: State, body: UnloadLoraRequest) -> Response:
    return await blocking(state.engine.unload_lora_adapter, body.lora_name)

