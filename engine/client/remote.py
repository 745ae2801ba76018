"""RemoteEngine: EngineClient over HTTP, against `python -m hotswap.engine.server`.

It duck-types as an Engine for the trainer side: WeightSender calls
`update_weights_from_distributed` from its own thread (the call blocks until the server has
received and applied the broadcast) while it broadcasts, so one client is shared across threads
(httpx clients are thread-safe). Errors come back as the in-process API raises them: 400 ->
ValueError with the server's message, 401 -> PermissionError, other failures -> RemoteEngineError.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np

from hotswap.engine.client.protocol import (
    CLASSIFY_PATH,
    EngineClient,
    HandoffClient,
    decode_outputs,
    routes_to_json,
)
from hotswap.engine.client.request import ClassifyRequest, DistributedUpdate, GenerateRequest
from hotswap.engine.errors import RemoteEngineError, WeightsIncompleteError
from hotswap.weight_sync.serialize import serialize_named_tensors


class RemoteEngine(EngineClient, HandoffClient):
    def __init__(self, url: str, api_key: str | None = None, admin_key: str | None = None,
                 timeout_s: float | None = None, connect_timeout_s: float = 10.0):
        """timeout_s: per-request read limit (None: wait as long as generation takes)."""
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.admin_key = admin_key
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._client = httpx.Client(base_url=self.url, timeout=self._timeout)
        self._async: dict[int, httpx.AsyncClient] = {}  # one per event loop
        self._weight_sync_ranks: int | None = None
        self._served: tuple[str, bool] | None = None  # (model name, frozen), asked once

    def __repr__(self) -> str:
        return f"RemoteEngine({self.url!r})"

    def shutdown(self) -> None:
        """Closes this client's connections; the server keeps running."""
        self._client.close()
        self._async.clear()

    def _headers(self, admin: bool) -> dict[str, str]:
        key = (self.admin_key or self.api_key) if admin else (self.api_key or self.admin_key)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              admin: bool = False) -> Any:
        response = self._client.request(method, path, json=body, headers=self._headers(admin))
        _raise_for_error(response.status_code, response.content)
        return response.json()

    def _post_control(self, path: str, **body: Any) -> Any:
        return self._call("POST", path, body, admin=True)

    # generation

    def _generate(self, request: GenerateRequest) -> dict | list[dict] | Iterator[dict]:
        if request.stream:
            return self._stream(request.body())
        return decode_outputs(self._call("POST", "/generate", request.body()))

    def _stream(self, body: dict[str, Any], path: str = "/generate") -> Iterator[dict]:
        with self._client.stream("POST", path, json=body,
                                 headers=self._headers(False)) as response:
            if response.status_code != 200:
                _raise_for_error(response.status_code, response.read())
            for line in response.iter_lines():
                event = _sse_event(line)
                if event is _DONE:
                    return
                if event is not None:
                    yield decode_outputs(event)

    async def _async_generate(self, request: GenerateRequest
                              ) -> dict | list[dict] | AsyncIterator[dict]:
        body = request.body()
        if request.stream:
            return self._astream(body)
        response = await self._async_client().post("/generate", json=body,
                                                    headers=self._headers(False))
        _raise_for_error(response.status_code, response.content)
        return decode_outputs(response.json())

    async def _astream(self, body: dict[str, Any]) -> AsyncIterator[dict]:
        client = self._async_client()
        async with client.stream("POST", "/generate", json=body,
                                 headers=self._headers(False)) as response:
            if response.status_code != 200:
                _raise_for_error(response.status_code, await response.aread())
            async for line in response.aiter_lines():
                event = _sse_event(line)
                if event is _DONE:
                    return
                if event is not None:
                    yield decode_outputs(event)

    # scoring: the native route takes ClassifyRequest's fields

    def _classify(self, request: ClassifyRequest) -> dict | list[dict]:
        return self._call("POST", CLASSIFY_PATH, request.body())

    async def _async_classify(self, request: ClassifyRequest) -> dict | list[dict]:
        response = await self._async_client().post(CLASSIFY_PATH, json=request.body(),
                                                    headers=self._headers(False))
        _raise_for_error(response.status_code, response.content)
        return response.json()

    def _async_client(self) -> httpx.AsyncClient:
        # An AsyncClient belongs to the loop it first ran on.
        loop = id(asyncio.get_running_loop())
        if loop not in self._async:
            self._async[loop] = httpx.AsyncClient(
                base_url=self.url, timeout=self._timeout,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._async[loop]

    # state and control

    def health(self) -> dict:
        return self._call("GET", "/health")

    def get_weight_version(self) -> str:
        return self._call("GET", "/get_weight_version")["weight_version"]

    @property
    def model_name(self) -> str:
        """The server's served model name (asked once)."""
        return self._served_model()[0]

    @property
    def frozen(self) -> bool:
        """Whether the server's model is frozen: its updates must name it (asked once)."""
        return self._served_model()[1]

    def _served_model(self) -> tuple[str, bool]:
        if self._served is None:
            info = self._call("GET", "/get_server_info")
            self._served = (str(info["served_model_name"]), bool(info.get("frozen", False)))
        return self._served

    def get_metrics(self) -> str:
        response = self._client.get("/metrics", headers=self._headers(False))
        _raise_for_error(response.status_code, response.content)
        return response.text

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, *, weight_version: str | None = None,
                                   pause_mode: str = "retract", commit: bool | None = None,
                                   model: str | None = None) -> dict:
        """The tensors travel in the body (base64 safetensors): one call per bucket; for a
        whole model prefer a WeightSender (update_weights_from_distributed)."""
        return self.update_weights_from_serialized(
            [serialize_named_tensors(named_tensors)], load_format, flush_cache,
            weight_version=weight_version, pause_mode=pause_mode, commit=commit, model=model)

    def update_weights_from_serialized(self, serialized_named_tensors: list[str],
                                       load_format: str | None = None, flush_cache: bool = True,
                                       *, weight_version: str | None = None,
                                       pause_mode: str = "retract",
                                       commit: bool | None = None,
                                       model: str | None = None) -> dict:
        return self._post_control(
            "/update_weights_from_tensor", serialized_named_tensors=serialized_named_tensors,
            load_format=load_format, flush_cache=flush_cache, weight_version=weight_version,
            pause_mode=pause_mode, commit=commit, **_named(model))

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None, *,
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 pause_mode: str = "retract", commit: bool | None = None,
                                 model: str | None = None) -> dict:
        return self._post_control("/update_weights_from_disk", model_path=model_path,
                                  load_format=load_format, weight_version=weight_version,
                                  flush_cache=flush_cache, pause_mode=pause_mode, commit=commit,
                                  **_named(model))

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False, *,
                              model: str | None = None) -> dict:
        return self._post_control("/update_weight_version", new_version=new_version,
                                  abort_all_requests=abort_all_requests, **_named(model))

    @property
    def weights_dtype(self) -> str:
        """The dtype the server keeps its weights in (a delta update carries it)."""
        return str(self._call("GET", "/get_server_info")["dtype"])

    @property
    def weight_sync_ranks(self) -> int:
        """Ranks the server takes in a trainer's weight-update group: its tensor-parallel size
        (every TP rank joins the group itself), or for a router every server's. Asked of the
        server once."""
        if self._weight_sync_ranks is None:
            info = self._call("GET", "/get_server_info")
            self._weight_sync_ranks = int(info.get("weight_sync_ranks", 1))
        return self._weight_sync_ranks

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "auto") -> dict:
        return self._post_control("/init_weights_update_group", master_address=master_address,
                                  master_port=master_port, rank_offset=rank_offset,
                                  world_size=world_size, group_name=group_name, backend=backend)

    def _update_weights_from_distributed(self, update: DistributedUpdate) -> dict:
        # Unset options stay out of the body: a server older than `staging` still takes it.
        return self._post_control("/update_weights_from_distributed", **update.body())

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._post_control("/destroy_weights_update_group", group_name=group_name)

    def _prepare_weights_from_distributed(self, update: DistributedUpdate) -> dict:
        return self._post_control("/prepare_weights_from_distributed", **update.body())

    def prepare_weights_from_disk(self, model_path: str, *, model: str | None = None) -> dict:
        return self._post_control("/prepare_weights_from_disk", model_path=model_path,
                                  **_named(model))

    def commit_weight_update(self, weight_version: str | None = None,
                             pause_mode: str | None = None) -> dict:
        return self._post_control("/commit_weight_update", weight_version=weight_version,
                                  pause_mode=pause_mode)

    def abort_weight_update(self) -> dict:
        return self._post_control("/abort_weight_update")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self._post_control("/get_weights_by_name", name=name, truncate_size=truncate_size)

    def pause_generation(self, mode: str = "retract") -> dict:
        return self._post_control("/pause_generation", mode=mode)

    def continue_generation(self) -> dict:
        return self._post_control("/continue_generation")

    def flush_cache(self, timeout_s: float | None = None) -> dict:
        return self._post_control("/flush_cache", timeout_s=timeout_s)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self._post_control("/abort_request", rid=rid, abort_all=abort_all)

    def check_integrity(self) -> None:
        result = self._post_control("/debug/check_integrity")
        if not result["success"]:
            raise AssertionError(result["message"])

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._post_control("/release_memory_occupation", tags=tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._post_control("/resume_memory_occupation", tags=tags)

    def load_lora_adapter(self, lora_name: str, lora_path: str, *,
                          pause_mode: str = "retract") -> dict:
        return self._post_control("/load_lora_adapter", lora_name=lora_name, lora_path=lora_path,
                                  pause_mode=pause_mode)

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict,
                                       *, pause_mode: str = "retract") -> dict:
        return self._post_control(
            "/load_lora_adapter_from_tensors", lora_name=lora_name,
            serialized_tensors=serialize_named_tensors(tensors), config_dict=config_dict,
            pause_mode=pause_mode)

    # prefill/decode handoff (docs/fleet.md#prefill-and-decode): the KV travels by shm or
    # the KV transfer group, never in the JSON

    def _prefill(self, request: GenerateRequest, transport: str) -> dict:
        if transport == "inline":
            raise ValueError('transport="inline" passes a tensor in-process; over HTTP use '
                             '"shm" (one host) or "group"')
        body = {**request.body(), "transport": "shm" if transport == "auto" else transport}
        return decode_outputs(self._call("POST", "/prefill", body))

    def _generate_from_handoff(self, handoff: dict, request: GenerateRequest
                               ) -> dict | list[dict] | Iterator[dict]:
        body = {**request.body(), "handoff": _routes_encoded(handoff)}
        if request.stream:
            return self._stream(body, "/generate_from_handoff")
        return decode_outputs(self._call("POST", "/generate_from_handoff", body))

    def init_kv_transfer_group(self, master_address: str, master_port: int, rank: int,
                               world_size: int, group_name: str = "kv_transfer",
                               backend: str = "auto") -> dict:
        return self._post_control("/init_kv_transfer_group", master_address=master_address,
                                  master_port=master_port, rank=rank, world_size=world_size,
                                  group_name=group_name, backend=backend)

    def send_kv_handoff(self, handoff_id: str, dst_rank: int) -> dict:
        return self._post_control("/send_kv_handoff", handoff_id=handoff_id,
                                  dst_rank=dst_rank)

    def drop_kv_handoff(self, handoff_id: str) -> bool:
        return self._post_control("/drop_kv_handoff", handoff_id=handoff_id)["success"]

    def destroy_kv_transfer_group(self) -> dict:
        return self._post_control("/destroy_kv_transfer_group")

    def open_session(self, ttl_s: float = 300.0, session_id: str | None = None) -> str:
        body = {"ttl_s": ttl_s, **({"session_id": session_id} if session_id else {})}
        return self._call("POST", "/open_session", body)["session_id"]

    def close_session(self, session_id: str) -> bool:
        try:
            self._call("POST", "/close_session", {"session_id": session_id})
        except RemoteEngineError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def list_lora_adapters(self) -> dict[str, int]:
        return self._call("GET", "/list_lora_adapters")

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._post_control("/unload_lora_adapter", lora_name=lora_name)


_DONE = object()


def _named(model: str | None) -> dict[str, str]:
    """An update body's model field, only when given (a server older than it takes the rest)."""
    return {} if model is None else {"model": model}


def _sse_event(line: str) -> Any:
    """The JSON of one `data:` line, _DONE at the end, None for other lines."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    event = json.loads(data)
    if "error" in event:
        raise RemoteEngineError(500, event["error"].get("message", "stream failed"))
    return event


def _routes_encoded(output: dict) -> dict:
    """A prefill output with its routed experts as JSON (the server decodes them back)."""
    meta = output.get("meta_info", {})
    if not isinstance(meta.get("routed_experts"), np.ndarray):
        return output
    return {**output, "meta_info": {**meta,
                                    "routed_experts": routes_to_json(meta["routed_experts"])}}


def _raise_for_error(status: int, content: bytes) -> None:
    if status < 400:
        return
    try:
        error = json.loads(content)["error"]
        message, kind = error["message"], error.get("type")
    except (ValueError, KeyError, TypeError):
        message, kind = content.decode("utf-8", "replace")[:1000], None
    if status == 400:
        raise ValueError(message)
    if status in (401, 403):
        raise PermissionError(message)
    if kind == "weights_incomplete":  # what the in-process Engine raises for the same state
        raise WeightsIncompleteError(message)
    raise RemoteEngineError(status, message)
