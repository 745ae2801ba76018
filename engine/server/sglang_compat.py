"""What SGLang's HTTP clients (verl, slime) send (docs/api.md#sglang-compatibility).

- GET where SGLang accepts it: /flush_cache, /health_generate, /get_model_info,
  /get_server_info, /v1/loads (/get_weight_version is GET already).
- /update_weight_version, and /update_weights_from_tensor taking serialized tensors (base64
  safetensors; one call per bucket, staged until a call with flush_cache true or /flush_cache).
- /generate's SGLang field names, translated here so the Engine sees only its own arguments.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

from hotswap.engine.client.protocol import check_update_model
from hotswap.engine.server.protocol import (
    Body,
    FlushRequest,
    GenerateBody,
    PauseMode,
)
from hotswap.engine.server.serving import State, blocking, error_response, json_response

sglang_routes = APIRouter()
sglang_control = APIRouter()

# Sampling keys SGLang's clients send that change nothing here (slime always sends them).
_IGNORED_SAMPLING = ("spaces_between_special_tokens",)
# Request fields SGLang's clients send as null or their default; anything else is refused.
_NULL_ONLY = ("token_ids_logprob", "custom_logit_processor")


class UpdateFromTensorRequest(Body):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    pause_mode: PauseMode = "retract"
    commit: bool | None = None  # None: commit when flush_cache is true (SGLang's meaning)
    model: str | None = None  # the model updated; a frozen one must be named


class UpdateWeightVersionRequest(Body):
    new_version: str
    abort_all_requests: bool = False
    model: str | None = None


class GenerateOptions:
    """What the response needs to know about an SGLang-style request."""

    def __init__(self, no_stop_trim: bool, logprob_text: bool | None):
        self.no_stop_trim = no_stop_trim
        self.logprob_text = logprob_text  # None: hotswap's [logprob, id] pairs


def translate_generate(body: GenerateBody) -> tuple[dict[str, Any], GenerateOptions]:
    """Engine.generate kwargs and response options from a /generate body."""
    kwargs = body.model_dump(exclude_defaults=True)
    for name in _NULL_ONLY:
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"{name} is not supported")
    kwargs.pop("logprob_start_len", None)  # input logprobs are never returned: nothing to start
    text = kwargs.pop("text", None)
    if text is not None:
        if "prompt" in kwargs:
            raise ValueError("give text or prompt, not both")
        kwargs["prompt"] = text
    lora_path = kwargs.pop("lora_path", None)
    if lora_path is not None:
        if "lora_name" in kwargs:
            raise ValueError("give lora_path or lora_name, not both")
        kwargs["lora_name"] = lora_path
    logprob_text = kwargs.pop("return_text_in_logprobs", None)
    params = kwargs.get("sampling_params")
    flags = [translate_sampling(p) for p in (params if isinstance(params, list) else [params])
             if p is not None]
    no_stop_trim = any(flags)
    if logprob_text is None and text is not None:
        logprob_text = False  # SGLang's shape for SGLang's request: [logprob, id, None]
    return kwargs, GenerateOptions(no_stop_trim, logprob_text)


def translate_sampling(params: dict[str, Any]) -> bool:
    """SGLang's sampling keys in place; returns no_stop_trim."""
    if "sampling_seed" in params:
        if params.get("seed") is not None:
            raise ValueError("sampling_params: give sampling_seed or seed, not both")
        params["seed"] = params.pop("sampling_seed")
    for key in _IGNORED_SAMPLING:
        params.pop(key, None)
    no_stop_trim = params.pop("no_stop_trim", False)
    if not isinstance(no_stop_trim, bool):
        raise ValueError("sampling_params.no_stop_trim: expected true or false")
    return no_stop_trim


def shape_output(out: dict, options: GenerateOptions, decode: Any) -> dict:
    """Apply no_stop_trim and SGLang's [logprob, id, text] logprob entries to one output."""
    meta = out["meta_info"]
    reason = meta.get("finish_reason") or {}
    if options.no_stop_trim and reason.get("type") == "stop" and isinstance(
            reason.get("matched"), str):
        out["text"] += reason["matched"]
    if options.logprob_text is None:
        return out
    def text_of(tid: int) -> str | None:
        return decode(tid) if options.logprob_text else None
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs"] = [[lp, t, text_of(t)]
                                         for lp, t in meta["output_token_logprobs"]]
    if "output_top_logprobs" in meta:
        meta["output_top_logprobs"] = [[[lp, t, text_of(t)] for lp, t in top]
                                       for top in meta["output_top_logprobs"]]
    return out


@sglang_routes.get("/health_generate")
async def health_generate(state: State) -> Response:
    """200 once the engine generates one token (SGLang's readiness probe)."""
    engine = state.engine
    await engine.async_generate(input_ids=[0], sampling_params={"max_new_tokens": 1,
                                                                "temperature": 0.0})
    return json_response({"status": "ok"})


@sglang_routes.get("/get_model_info")
async def get_model_info(state: State) -> Response:
    config = state.engine.config
    return json_response({"model_path": config.model_path, "tokenizer_path": config.model_path,
                          "is_generation": True, "preferred_sampling_params": None,
                          "weight_version": state.engine.get_weight_version()})


@sglang_routes.get("/get_server_info")
async def get_server_info(state: State) -> Response:
    config = state.engine.config
    info = {k: v for k, v in vars(config).items() if isinstance(v, (str, int, float, bool))}
    chat = state.chat
    info["tool_call_parser"] = chat.tool_parser.name if chat.tool_parser else None
    info["reasoning_parser"] = chat.reasoning_parser.name if chat.reasoning_parser else None
    return json_response({**info, "weight_version": state.engine.get_weight_version(),
                          "weight_sync_ranks": state.engine.weight_sync_ranks,
                          "max_total_num_tokens": state.engine.get_load()["kv_pool_tokens"],
                          "version": "hotswap"})


@sglang_routes.get("/v1/loads")
async def loads(state: State) -> Response:
    load = state.engine.get_load()
    size, used = load["kv_pool_tokens"], load["kv_used_tokens"]
    return json_response({"loads": [{
        "dp_rank": 0, "num_running_reqs": load["running"],
        "num_waiting_reqs": load["waiting"] + load["forked"] + load["compiling"],
        "num_used_tokens": used, "max_total_num_tokens": size,
        "token_usage": used / size if size else 0.0}]})


@sglang_control.get("/flush_cache")
async def flush_cache_get(state: State) -> Response:
    result = await asyncio.to_thread(state.engine.flush_cache, FlushRequest().timeout_s)
    # SGLang answers 400 while requests are in flight; verl and slime retry until 200.
    if not result.get("success"):
        return error_response(400, result.get("message", "flush failed"), "flush_failed")
    return json_response(result)


@sglang_control.post("/update_weights_from_tensor")
async def update_weights_from_tensor(state: State, body: UpdateFromTensorRequest) -> Response:
    if body.abort_all_requests:
        check_update_model(state.model_name, state.engine.config.frozen, body.model)
        state.engine.abort_request(abort_all=True)
    return await blocking(state.engine.update_weights_from_serialized,
                          body.serialized_named_tensors, body.load_format, body.flush_cache,
                          weight_version=body.weight_version, pause_mode=body.pause_mode,
                          commit=body.commit, model=body.model)


@sglang_control.post("/update_weight_version")
async def update_weight_version(state: State, body: UpdateWeightVersionRequest) -> Response:
    return await blocking(state.engine.update_weight_version, body.new_version,
                          body.abort_all_requests, model=body.model)
