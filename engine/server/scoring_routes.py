"""The routes RL trainers call to score with a reward model (docs/api.md#scoring-over-http), each
taking its caller's payload as that caller's code builds it and answering the fields it reads.

- `/v1/classify`: vLLM's pooling classify API (verl's reward loop with a vLLM reward model).
- `/classify`: vLLM's shape, or SGLang's native one (`text` or `input_ids`), answered in the
  shape the request used.
- `/v1/embeddings`: the scores as the embedding (verl's reward loop with an SGLang reward model).
- `/get_reward`: OpenRLHF's remote reward model (`query`) or slime's remote_rm (`response`).

Text is scored as given (tokenized as vLLM and SGLang do, special tokens added unless the request
says otherwise); chat messages go through the reward model's chat template. Scores are raw unless
the vLLM shape asks for the activation (vLLM's default).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from functools import lru_cache
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator
from starlette.exceptions import HTTPException
from starlette.responses import Response

from hotswap.engine.server.protocol import Body, ChatMessage, NonNegInt, Text
from hotswap.engine.server.serving import (
    CLIENT_GONE,
    ServerState,
    State,
    json_response,
    until_disconnect,
)

scoring_routes = APIRouter()

TextList = Annotated[list[Text], Field(min_length=1)]
Ids = Annotated[list[NonNegInt], Field(min_length=1)]
IdsList = Annotated[list[Ids], Field(min_length=1)]


def _token_id(t: Any) -> bool:
    whole = (isinstance(t, int) and not isinstance(t, bool)) or (
        isinstance(t, float) and t.is_integer())  # JSON has one number type: 8.0 is 8
    return whole and t >= 0


def _one_of_the_input_forms(value: Any) -> Any:
    # One message for the four forms, where the union would list each member's complaint.
    def texts(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, str) and t for t in v)

    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(_token_id(t) for t in v)

    if (isinstance(value, str) and value) or texts(value) or ids(value) or (
            isinstance(value, list) and value and all(ids(v) for v in value)):
        return value
    raise ValueError("must be a non-empty string, a list of them, a list of token ids "
                     "(non-negative integers), or a list of such lists")


# OpenAI's `input`: one text, texts, one token id list, or several.
Inputs = Annotated[Text | TextList | Ids | IdsList, BeforeValidator(_one_of_the_input_forms)]


class ClassificationBody(Body):
    """vLLM's ClassificationRequest: `input` (completion form) or `messages` (chat form)."""

    model: str | None = None
    input: Inputs | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    user: str | None = None
    use_activation: bool | None = None
    activation: bool | None = None  # use_activation's name before vLLM 0.11.2 (verl sends it)
    add_special_tokens: bool | None = None  # None: vLLM's default (true for input, not chats)
    # keep the last N tokens; -1: as many as the context holds
    truncate_prompt_tokens: Literal[-1] | Annotated[NonNegInt, Field(ge=1)] | None = None
    cache_salt: Text | None = None

    @model_validator(mode="after")
    def _one_form(self) -> ClassificationBody:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of input and messages")
        if None not in (self.activation, self.use_activation) and (
                self.activation != self.use_activation):
            raise ValueError("activation and use_activation disagree")
        if self.messages is not None and (self.add_special_tokens or
                                          self.truncate_prompt_tokens is not None):
            raise ValueError("add_special_tokens and truncate_prompt_tokens go with input, not "
                             "messages")
        return self

    @property
    def wants_activation(self) -> bool:
        chosen = self.use_activation if self.use_activation is not None else self.activation
        return True if chosen is None else chosen  # vLLM's pooler applies it by default


class SGLangClassifyBody(Body):
    """SGLang's native /classify (its EmbeddingReqInput): one prompt or a list of them."""

    text: Text | TextList | None = None
    input_ids: Ids | IdsList | None = None
    rid: Text | list[Text] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> SGLangClassifyBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self


def _classify_shape(body: Any) -> str:
    return "sglang" if isinstance(body, dict) and ("text" in body or "input_ids" in body) else (
        "vllm")


ClassifyAnyBody = Annotated[Annotated[ClassificationBody, Tag("vllm")]
                            | Annotated[SGLangClassifyBody, Tag("sglang")],
                            Discriminator(_classify_shape)]


class EmbeddingBody(Body):
    """SGLang's /v1/embeddings request (what verl's reward loop posts to an SGLang RM)."""

    model: str | None = None
    input: Inputs
    encoding_format: Literal["float"] = "float"
    user: str | None = None


class OpenRLHFRewardBody(Body):
    """OpenRLHF's remote reward model call: `query` holds full texts (prompt + response)."""

    query: list[Text]  # empty where OpenRLHF splits fewer queries than it has servers
    prompts: list[str] | None = None
    labels: list[Any] | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> OpenRLHFRewardBody:
        for name in ("prompts", "labels"):
            given = getattr(self, name)
            if given is not None and len(given) != len(self.query):
                raise ValueError(f"{name}: {len(given)} entries for {len(self.query)} queries")
        return self


class SlimeRewardBody(Body):
    """slime's remote_rm: one sample; `prompt` is templated text or chat messages."""

    prompt: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    response: str
    label: Any = None


def _reward_shape(body: Any) -> str:
    return "openrlhf" if isinstance(body, dict) and "query" in body else "slime"


RewardAnyBody = Annotated[Annotated[OpenRLHFRewardBody, Tag("openrlhf")]
                          | Annotated[SlimeRewardBody, Tag("slime")],
                          Discriminator(_reward_shape)]


def _check_model(state: ServerState, model: str | None) -> None:
    """A body's `model` names this server's model: its served name or its model path (what
    vLLM and SGLang call a model by default, and what verl sends)."""
    served = (state.model_name, state.engine.config.model_path)
    if model is not None and model not in served:
        raise HTTPException(404, f"model {model!r} is not served here; this server serves "
                                 f"{state.model_name!r} (or give its model path)")


async def _score(state: ServerState, request: Request, **kwargs: Any) -> Any:
    """Engine.async_classify's outputs, or CLIENT_GONE."""
    return await until_disconnect(request, state.engine.async_classify(**kwargs))


def _openai_inputs(state: ServerState, value: Any, add_special_tokens: bool = True,
                   keep_last: int | None = None) -> dict[str, Any]:
    """classify's prompt (texts) or input_ids (lists) for an OpenAI-style `input`, always a
    list; texts are tokenized here when the engine's own tokenization will not do."""
    items = [value] if isinstance(value, str) or isinstance(value[0], int) else value
    if isinstance(items[0], str):
        if add_special_tokens and keep_last is None:
            return {"prompt": items}
        encode = state.engine.tokenizer.encode
        items = [encode(text, add_special_tokens=add_special_tokens) for text in items]
    if keep_last is not None:
        items = [ids[-keep_last:] for ids in items]
    return {"input_ids": items}


def _usage(outs: list[dict]) -> dict[str, Any]:
    tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _top(scores: list[float]) -> int:
    return max(range(len(scores)), key=scores.__getitem__)


@lru_cache(maxsize=8)
def _labels(model_path: str, num_labels: int) -> list[str]:
    """config.json's id2label in class order (HF's LABEL_i where it names none)."""
    with open(os.path.join(model_path, "config.json")) as f:
        names = json.load(f).get("id2label") or {}
    return [names.get(str(i), f"LABEL_{i}") for i in range(num_labels)]


async def _vllm_classify(state: ServerState, body: ClassificationBody,
                         request: Request) -> Response:
    _check_model(state, body.model)
    if body.messages is not None:
        inputs = {"messages": [[m.model_dump(exclude_none=True) for m in body.messages]]}
    else:
        keep = body.truncate_prompt_tokens
        keep = state.engine.config.context_length - 1 if keep == -1 else keep
        inputs = _openai_inputs(state, body.input, body.add_special_tokens is not False, keep)
    outs = await _score(state, request, **inputs, activation=body.wants_activation,
                       cache_salt=body.cache_salt)
    if outs is CLIENT_GONE:
        return Response(status_code=499)
    names = _labels(state.engine.config.model_path, len(outs[0]["scores"]))
    data = [{"index": i, "label": names[_top(o["scores"])], "probs": o["scores"],
             "num_classes": len(o["scores"])} for i, o in enumerate(outs)]
    return json_response({"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                          "created": int(time.time()), "model": state.model_name,
                          "data": data, "usage": _usage(outs)})


@scoring_routes.post("/v1/classify")
async def v1_classify(state: State, body: ClassificationBody, request: Request) -> Response:
    return await _vllm_classify(state, body, request)


@scoring_routes.post("/classify")
async def classify(state: State, body: ClassifyAnyBody, request: Request) -> Response:
    """vLLM's /classify, or SGLang's native one when the body has `text` or `input_ids`."""
    if isinstance(body, ClassificationBody):
        return await _vllm_classify(state, body, request)
    out = await _score(state, request, prompt=body.text, input_ids=body.input_ids, rid=body.rid)
    if out is CLIENT_GONE:
        return Response(status_code=499)
    if isinstance(out, list):
        return json_response([_as_embedding(o) for o in out])
    return json_response(_as_embedding(out))


def _as_embedding(out: dict) -> dict:
    """SGLang's output of an embedding or reward model: the scores as the embedding."""
    return {"embedding": out["scores"], "meta_info": out["meta_info"]}


@scoring_routes.post("/v1/embeddings")
async def embeddings(state: State, body: EmbeddingBody, request: Request) -> Response:
    """The raw scores as each input's embedding, as an SGLang reward model serves them."""
    _check_model(state, body.model)
    outs = await _score(state, request, **_openai_inputs(state, body.input))
    if outs is CLIENT_GONE:
        return Response(status_code=499)
    data = [{"object": "embedding", "embedding": o["scores"], "index": i}
            for i, o in enumerate(outs)]
    return json_response({"object": "list", "data": data, "model": state.model_name,
                          "usage": _usage(outs)})


@scoring_routes.post("/get_reward")
async def get_reward(state: State, body: RewardAnyBody, request: Request) -> Response:
    """One raw score per sequence (the last class's where the model has several): OpenRLHF's
    {"rewards", "scores", "extra_logs"} for its `query` list, a bare number for slime's sample."""
    if isinstance(body, OpenRLHFRewardBody):
        outs = await _score(state, request, prompt=body.query) if body.query else []
    elif isinstance(body.prompt, str):
        outs = await _score(state, request, prompt=[body.prompt + body.response])
    else:
        chat = [*body.prompt, {"role": "assistant", "content": body.response}]
        outs = await _score(state, request, messages=[chat])
    if outs is CLIENT_GONE:
        return Response(status_code=499)
    rewards = [o["scores"][-1] for o in outs]
    if isinstance(body, SlimeRewardBody):
        return json_response(rewards[0])
    return json_response({"rewards": rewards, "scores": rewards, "extra_logs": {}})
