"""HTTP request bodies: OpenAI-compatible, native and control plane, as pydantic models.

Every model forbids unknown fields and coerces nothing ("10" is not an integer), so a typo or a
wrong type is a 400 naming the field, not a silently ignored or reinterpreted value. Ranges that
only the engine knows (vocabulary, context length, sampling limits) are left to its validation.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    create_model,
    model_validator,
)

from hotswap.engine.client.protocol import MAX_N, PAUSE_MODES, STAGING_MODES
from hotswap.engine.client.request import ClassifyRequest, DistributedUpdate, GenerateRequest

PauseMode = Literal[PAUSE_MODES]  # the engine's rules, so the OpenAPI schema shows them
Staging = Literal[STAGING_MODES]
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_ABS_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties
MAX_TOOLS = 128  # OpenAI's limit for tools



def _whole_number(value: Any) -> Any:
    # JSON has one number type: 8.0 is a valid "integer" in JSON Schema, "8" is not.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(**bounds: int) -> Any:
    """An integer type; bounds sit inside it so the OpenAPI schema shows them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


Int = _int()
NonNegInt = _int(ge=0)
SampleCount = _int(ge=1, le=MAX_N)
TopLogprobs = _int(ge=0, le=MAX_TOP_LOGPROBS)
TopK = _int(ge=-1)
Port = _int(ge=1, le=65535)
Rank = _int(ge=1)
WorldSize = _int(ge=2)
TruncateSize = _int(ge=0, le=1 << 20)
Text = Annotated[str, StringConstraints(min_length=1)]
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]+$")]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    """Fields shared by /v1/completions and /v1/chat/completions, plus common extensions."""

    model: str | None = None
    max_tokens: NonNegInt | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: SampleCount = 1
    stop: Text | list[Text] | None = None
    seed: Int | None = None
    presence_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    logit_bias: dict[TokenIdKey, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions (as in SGLang and vLLM).
    top_k: TopK | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: NonNegInt | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[NonNegInt] | None = None
    regex: str | None = None
    cache_salt: str | None = None
    session_id: Text | None = None  # an open session's (/open_session): the turn stays pinned


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[NonNegInt] | list[list[NonNegInt]]
    echo: bool = False
    logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None  # as on chat (vLLM and SGLang accept it)

    @model_validator(mode="after")
    def _no_echo(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        return self


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImageUrl(Body):
    url: str  # a data: URL (base64); nothing is fetched
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's size rules apply


class ImageUrlPart(Body):
    type: Literal["image_url"]
    image_url: ImageUrl


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class CalledFunction(Body):
    name: FunctionName
    arguments: str  # JSON text of an object, as OpenAI sends it

    @model_validator(mode="after")
    def _arguments_are_an_object(self) -> CalledFunction:
        try:
            args = json.loads(self.arguments)
        except ValueError as exc:
            raise ValueError(f"arguments: not valid JSON: {exc}") from None
        if not isinstance(args, dict):
            raise ValueError("arguments: must be a JSON object")
        return self


class MessageToolCall(Body):
    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImageUrlPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant only
    tool_call_id: Text | None = None  # tool only: the call it answers
    reasoning_content: str | None = None  # assistant only

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("reasoning_content: only assistant messages carry reasoning")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message needs one, other roles have none")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (only an assistant message with tool_calls "
                             "may leave it out)")
        return self


class FunctionDef(Body):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object
    strict: bool | None = None

    @model_validator(mode="after")
    def _parameters_are_an_object_schema(self) -> FunctionDef:
        kind = (self.parameters or {}).get("type", "object")
        if kind != "object":
            raise ValueError(f"parameters: must be the JSON schema of an object, got type "
                             f"{kind!r}")
        return self


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(Body):
    name: FunctionName


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(Body):
    name: str
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema is required with type 'json_schema' "
                             "and allowed only with it")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    @model_validator(mode="after")
    def _tools_agree(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not in tools")
        if choice not in (None, "none", "auto") and self.response_format is not None:
            raise ValueError("response_format: cannot be combined with a tool_choice that "
                             "forces a call")
        if self.tools and self.regex is not None:
            raise ValueError("regex: cannot be combined with tools")
        _check_tool_history(self.messages)
        return self


def _check_tool_history(messages: list[ChatMessage]) -> None:
    """Every tool message answers a call of an earlier assistant message, once; call ids are
    unique."""
    open_calls: set[str] = set()
    seen: set[str] = set()
    for i, m in enumerate(messages):
        for k, call in enumerate(m.tool_calls or []):
            if call.id in seen:
                raise ValueError(f"messages.{i}.tool_calls.{k}.id: {call.id!r} is used twice")
            seen.add(call.id)
            open_calls.add(call.id)
        if m.role == "tool":
            if m.tool_call_id not in open_calls:
                raise ValueError(f"messages.{i}.tool_call_id: {m.tool_call_id!r} answers no "
                                 "open tool call of an earlier assistant message")
            open_calls.discard(m.tool_call_id)


def request_body(name: str, request_type: type = GenerateRequest, drop: tuple[str, ...] = (),
                 refined: dict[str, Any] | None = None, **extra: Any) -> type[Body]:
    """A body model of an engine call's arguments, `request_type`'s fields (less `drop`) plus
    `extra` fields ((type, default) pairs), so a route takes exactly what the call does;
    `refined` gives a field a stricter JSON type (ids and counts are JSON numbers: 8.0 is 8)."""
    hints = typing.get_type_hints(request_type)
    refined = {**_REFINED.get(request_type, {}), **(refined or {})}
    fields = {f.name: (refined.get(f.name, hints[f.name]),
                       ... if f.default is dataclasses.MISSING else f.default)
              for f in dataclasses.fields(request_type) if f.name not in drop}
    return create_model(name, __base__=Body, **fields, **extra)


_REFINED: dict[type, dict[str, Any]] = {
    GenerateRequest: {"input_ids": list[NonNegInt] | list[list[NonNegInt]] | None,
                      "top_logprobs_num": Int},
    ClassifyRequest: {"input_ids": list[NonNegInt] | list[list[NonNegInt]] | None,
                      "step_tag_id": NonNegInt | None,
                      "returned_token_ids": list[NonNegInt] | None},
    DistributedUpdate: {"shapes": list[list[Int]], "pause_mode": PauseMode,
                        "load_format": Literal["flattened_bucket", "delta"] | None,
                        "staging": Staging | None}}


# The native route: Engine.generate's arguments (the engine validates their contents), with
# SGLang's names and fields (translated or refused in sglang_compat.py).
GenerateBody = request_body(
    "GenerateRequest", text=(str | list[str] | None, None),
    logprob_start_len=(Int | None, None), token_ids_logprob=(Any, None),
    lora_path=(str | list[str | None] | None, None), custom_logit_processor=(Any, None),
    return_text_in_logprobs=(bool | None, None))


# classify's native route: exactly Engine.classify's arguments.
ClassifyBody = request_body("ClassifyRequest", ClassifyRequest)


class OpenSessionRequest(Body):
    ttl_s: float = Field(300.0, gt=0)
    session_id: Text | None = None


class CloseSessionRequest(Body):
    session_id: Text


class UpdateFromDiskRequest(Body):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True  # accepted and ignored: see Engine's update methods
    pause_mode: PauseMode = "retract"
    commit: bool | None = None  # None: commit when flush_cache is true (resolve_commit)
    model: str | None = None  # the model updated; a frozen one must be named


class InitGroupRequest(Body):
    master_address: str
    master_port: Port
    rank_offset: Rank
    world_size: WorldSize
    group_name: str = "weight_update_group"
    backend: Literal["auto", "gloo", "nccl"] = "auto"


UpdateFromDistributedRequest = request_body("UpdateFromDistributedRequest", DistributedUpdate)
PrepareFromDistributedRequest = request_body("PrepareFromDistributedRequest", DistributedUpdate,
                                             drop=DistributedUpdate.COMMIT_FIELDS)


class GroupRequest(Body):
    group_name: str = "weight_update_group"


class PauseRequest(Body):
    mode: PauseMode = "retract"


class FlushRequest(Body):
    timeout_s: float | None = Field(None, ge=0)


class AbortRequest(Body):
    rid: str | None = None
    abort_all: bool = False


class WeightsByNameRequest(Body):
    name: str
    truncate_size: TruncateSize = 100


class MemoryRequest(Body):
    tags: list[Literal["weights", "kv_cache"]] | None = None


class LoadLoraRequest(Body):
    lora_name: str
    lora_path: str
    pause_mode: PauseMode = "retract"


class LoadLoraFromTensorsRequest(Body):
    lora_name: str
    serialized_tensors: str  # base64 safetensors of the PEFT tensors
    config_dict: dict[str, Any]
    pause_mode: PauseMode = "retract"


class UnloadLoraRequest(Body):
    lora_name: str
