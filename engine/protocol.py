"""HTTP request bodies: OpenAI-compatible, native and control plane, as pydantic models.

Every model forbids unknown fields and coerces nothing ("10" is not an integer), so a typo or a
wrong type is a 400 naming the field, not a silently ignored or reinterpreted value. Ranges that
only the engine knows (vocabulary, context length, sampling limits) are left to its validation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PauseMode = Literal["abort", "retract", "in_place"]
MAX_N = 1024  # the engine's limit (sampling.MAX_N), stated here so the OpenAPI schema shows it
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    """Fields shared by /v1/completions and /v1/chat/completions, plus common extensions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions (as in SGLang and vLLM).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    regex: str | None = None
    cache_salt: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _no_echo(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        return self


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None


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
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self


class GenerateRequest(Body):
    """The native route: Engine.generate's arguments; the engine validates their contents."""

    prompt: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    lora_name: str | list[str | None] | None = None
    cache_salt: str | list[str | None] | None = None
    rid: str | list[str | None] | None = None
    stream: bool = False


class UpdateFromDiskRequest(Body):
    model_path: str
    weight_version: str | None = None
    flush_cache: bool = True
    pause_mode: PauseMode = "retract"


class InitGroupRequest(Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["auto", "gloo", "nccl"] = "auto"


class UpdateFromDistributedRequest(Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    flush_cache: bool = True
    pause_mode: PauseMode = "retract"
    load_format: Literal["flattened_bucket"] | None = None


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
    truncate_size: int = Field(100, ge=0, le=1 << 20)


class MemoryRequest(Body):
    tags: list[Literal["weights", "kv_cache"]] | None = None


class LoadLoraRequest(Body):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(Body):
    lora_name: str
