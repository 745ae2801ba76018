"""Control routes of the weight-update transaction that are hotswap's own: prepare (receive and
validate beside the serving weights), and commit or abort of whichever update is open (prepared,
or pieces sent with commit=False to SGLang's update routes).

A coordinator of several servers (a WeightSender with several RemoteEngine targets, the Router)
prepares every server first and commits only when all prepared, so none ends on another version.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from hotswap.engine.server.control_api import _update
from hotswap.engine.server.protocol import (
    Body,
    PauseMode,
    PrepareFromDistributedRequest,
)
from hotswap.engine.server.serving import State, blocking

update_routes = APIRouter()


class PrepareFromDiskRequest(Body):
    model_path: str
    model: str | None = None


class CommitRequest(Body):
    weight_version: str | None = None
    pause_mode: PauseMode | None = None  # a prepared update's (None: "retract")


@update_routes.post("/prepare_weights_from_distributed")
async def prepare_weights_from_distributed(state: State,
                                           body: PrepareFromDistributedRequest) -> Response:
    return await blocking(state.engine.prepare_weights_from_distributed, **body.model_dump())


@update_routes.post("/prepare_weights_from_disk")
async def prepare_weights_from_disk(state: State, body: PrepareFromDiskRequest) -> Response:
    return await blocking(state.engine.prepare_weights_from_disk, body.model_path,
                          model=body.model)


@update_routes.post("/commit_weight_update")
async def commit_weight_update(state: State, body: CommitRequest | None = None) -> Response:
    body = body or CommitRequest()
    return await _update(state, "commit", state.engine.commit_weight_update,
                         **body.model_dump())


@update_routes.post("/abort_weight_update")
async def abort_weight_update(state: State) -> Response:
    return await blocking(state.engine.abort_weight_update)
