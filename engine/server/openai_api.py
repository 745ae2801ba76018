"""OpenAI-compatible completions and chat completions mapped onto Engine.async_generate.

A request becomes one engine call with one rid per prompt (`{id}-{i}`); the engine names the
k-th of n samples `{id}-{i}-{k}`, which gives each output its OpenAI choice index i * n + k.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Container
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from hotswap.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    SamplingFields,
)

LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token with zero probability

_PASSED = ("temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
           "logit_bias", "top_k", "min_p", "repetition_penalty", "ignore_eos",
           "skip_special_tokens", "stop_token_ids", "regex", "n")


@dataclass
class Job:
    """One OpenAI request as an engine call, and how its outputs map back to choices."""

    id: str
    kind: str  # "text_completion" | "chat.completion"
    model: str
    n: int
    num_prompts: int
    top_logprobs: int | None  # None: no logprobs asked
    include_usage: bool
    engine_kwargs: dict[str, Any]
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def rids(self) -> list[str]:
        """Engine output ids in choice order."""
        base = [f"{self.id}-{i}" for i in range(self.num_prompts)]
        return base if self.n == 1 else [f"{b}-{k}" for b in base for k in range(self.n)]


def sampling_params(req: SamplingFields, max_tokens: int) -> dict[str, Any]:
    """The engine's sampling params; fields left unset keep the engine's defaults."""
    params = {name: getattr(req, name) for name in _PASSED if getattr(req, name) is not None}
    params["max_new_tokens"] = max_tokens
    if req.min_tokens is not None:
        params["min_new_tokens"] = req.min_tokens
    return params


def completion_job(req: CompletionRequest, model: str) -> Job:
    prompt = req.prompt
    by_ids = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], str)
    single = isinstance(prompt, str) or (by_ids and isinstance(prompt[0], int))
    count = 1 if single else len(prompt)
    job_id = f"cmpl-{uuid.uuid4().hex}"
    # OpenAI's default for completions is 16 tokens.
    params = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens)
    _add_response_format(params, req.response_format)
    kwargs: dict[str, Any] = {("input_ids" if by_ids else "prompt"): prompt,
                              "sampling_params": params,
                              "rid": f"{job_id}-0" if single else
                              [f"{job_id}-{i}" for i in range(count)]}
    _add_logprobs(kwargs, req.logprobs)
    _add_common(kwargs, req)
    return Job(job_id, "text_completion", req.model or model, req.n, count, req.logprobs,
               _include_usage(req), kwargs)


def chat_job(req: ChatCompletionRequest, model: str, context_length: int) -> Job:
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    # Unset: generate until eos or the context is full, as OpenAI does.
    params = sampling_params(req, context_length if max_tokens is None else max_tokens)
    _add_response_format(params, req.response_format)
    messages = [{"role": m.role, "content": _content_text(m.content)} for m in req.messages]
    kwargs: dict[str, Any] = {"messages": messages, "sampling_params": params,
                              "rid": f"{job_id}-0"}
    top = (req.top_logprobs or 0) if req.logprobs else None
    _add_logprobs(kwargs, top)
    _add_common(kwargs, req)
    return Job(job_id, "chat.completion", req.model or model, req.n, 1, top,
               _include_usage(req), kwargs)


def _add_response_format(params: dict[str, Any], fmt: ResponseFormat | None) -> None:
    """OpenAI's structured output as the engine's json_schema grammar (json_object: any
    JSON object). A schema the grammar cannot compile is a 400 from the engine."""
    if fmt is not None and fmt.type == "json_schema":
        params["json_schema"] = fmt.json_schema.json_schema
    elif fmt is not None and fmt.type == "json_object":
        params["json_schema"] = {"type": "object"}


def _content_text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _add_logprobs(kwargs: dict[str, Any], top: int | None) -> None:
    if top is not None:
        kwargs["return_logprob"] = True
        kwargs["top_logprobs_num"] = top


def _add_common(kwargs: dict[str, Any], req: SamplingFields) -> None:
    if req.cache_salt is not None:
        kwargs["cache_salt"] = req.cache_salt


def _include_usage(req: SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


class Formatter:
    """Builds OpenAI response bodies and stream chunks from engine outputs."""

    def __init__(self, decode_token: Callable[[int], str]):
        self.decode_token = decode_token

    def response(self, job: Job, outs: list[dict[str, Any]]) -> dict[str, Any]:
        by_id = {o["meta_info"]["id"]: o for o in outs}
        choices = [self._choice(job, i, by_id[rid]) for i, rid in enumerate(job.rids)]
        return {"id": job.id, "object": job.kind, "created": job.created, "model": job.model,
                "choices": choices, "usage": usage(job, [by_id[r]["meta_info"] for r in job.rids])}

    def _choice(self, job: Job, index: int, out: dict[str, Any]) -> dict[str, Any]:
        meta = out["meta_info"]
        choice: dict[str, Any] = {"index": index, **finish_fields(meta)}
        logprobs = self.logprobs(job, meta, out["output_ids"])
        if job.kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": out["text"]}
        else:
            choice["text"] = out["text"]
        choice["logprobs"] = logprobs
        choice["weight_version"] = meta.get("weight_version")
        return choice

    def logprobs(self, job: Job, meta: dict[str, Any], ids: list[int]) -> dict[str, Any] | None:
        if job.top_logprobs is None:
            return None
        lps = [finite(lp) for lp, _ in meta.get("output_token_logprobs", [])]
        tops = meta.get("output_top_logprobs") or [[] for _ in ids]
        tokens = [self.decode_token(t) for t in ids]
        if job.kind == "chat.completion":
            return {"content": [
                {**_token_entry(tok, lp),
                 "top_logprobs": [_token_entry(self.decode_token(t), finite(v)) for v, t in top]}
                for tok, lp, top in zip(tokens, lps, tops)]}
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
                "top_logprobs": [{self.decode_token(t): finite(v) for v, t in top}
                                 for top in tops] if job.top_logprobs else None}

    def chunk(self, job: Job, choices: list[dict[str, Any]],
              usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {"id": job.id, "object": f"{job.kind}.chunk" if job.kind == "chat.completion"
                else job.kind, "created": job.created, "model": job.model, "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body

    def delta_choice(self, job: Job, index: int, event: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk choice for one engine stream event; None when it carries nothing."""
        meta = event["meta_info"]
        if not event["text"] and meta["finish_reason"] is None and (
                job.top_logprobs is None or not event["output_ids"]):
            return None
        choice: dict[str, Any] = {"index": index}
        if job.kind == "chat.completion":
            choice["delta"] = {"content": event["text"]} if event["text"] else {}
        else:
            choice["text"] = event["text"]
        choice["logprobs"] = self.logprobs(job, meta, event["output_ids"])
        choice.update(finish_fields(meta))
        return choice

    async def stream(self, job: Job, events: AsyncIterator[dict[str, Any]]
                     ) -> AsyncIterator[dict[str, Any]]:
        """Chunks for an engine event stream; usage last when the client asked for it."""
        index = {rid: i for i, rid in enumerate(job.rids)}
        if job.kind == "chat.completion":
            yield self.chunk(job, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}
                                   for i in range(len(index))])
        finals: dict[str, dict[str, Any]] = {}
        async with aclosing(events):
            async for event in events:
                meta = event["meta_info"]
                if meta["finish_reason"] is not None:
                    finals[meta["id"]] = meta
                choice = self.delta_choice(job, index[meta["id"]], event)
                if choice is not None:
                    yield self.chunk(job, [choice])
        if job.include_usage:
            yield self.chunk(job, [], usage(job, [finals[r] for r in job.rids if r in finals]))


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def finish_fields(meta: dict[str, Any]) -> dict[str, Any]:
    reason = meta["finish_reason"]
    if reason is None:
        return {"finish_reason": None}
    return {"finish_reason": reason["type"], "matched_stop": reason.get("matched")}


def usage(job: Job, metas: list[dict[str, Any]]) -> dict[str, Any]:
    # The n samples of a prompt share it: count each prompt once.
    prompt = sum(m["prompt_tokens"] for m in metas[::job.n])
    cached = sum(m.get("cached_tokens", 0) for m in metas[::job.n])
    completion = sum(m["completion_tokens"] for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def lora_for_model(model: str, served: str, loaded: Container[str]) -> str | None:
    """The adapter an OpenAI `model` field names: "base:adapter" or a loaded adapter's name;
    any other name means the base model (clients often send a placeholder)."""
    if ":" in model:
        prefix, adapter = model.rsplit(":", 1)
        if prefix == served or adapter in loaded:
            return adapter
    return model if model in loaded else None
