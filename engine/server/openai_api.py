"""OpenAI-compatible completions and chat completions mapped onto Engine.async_generate.

A request becomes one engine call with one rid per prompt (`{id}-{i}`); the engine names the
k-th of n samples `{id}-{i}-{k}`, which gives each output its OpenAI choice index i * n + k.

Chat requests are rendered here (hotswap.engine.parsers.chat: tools, template arguments, the
model's own tokens for turns generated here) and sent as input ids. Their outputs are read
through the server's reasoning and tool-call parsers: whole for a response, incrementally for
a stream (parsers.streaming). A call forced by `tool_choice` is constrained by a grammar
(parsers.grammar), and so is a call under `auto` where the format opens calls with a tag.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Container
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from hotswap.engine.parsers import ReasoningParser, ToolParser
from hotswap.engine.parsers.chat import TurnMemory, render, turn_key
from hotswap.engine.parsers.grammar import auto_calls_ebnf, forced_calls_ebnf
from hotswap.engine.parsers.streaming import ReasoningStream, ToolStream
from hotswap.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ImageUrlPart,
    NamedToolChoice,
    ResponseFormat,
    SamplingFields,
)

logger = logging.getLogger("hotswap.server")

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
    tools: ToolParser | None = None  # chat: the outputs' calls are read with it
    reasoning: ReasoningParser | None = None  # chat: the outputs' reasoning is split with it

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


@dataclass
class ChatSetup:
    """What the server reads chat with: its tokenizer, its parsers (None: off), the memory of
    the assistant turns it generated."""

    tokenizer: Any
    tool_parser: ToolParser | None
    reasoning_parser: ReasoningParser | None
    memory: TurnMemory = field(default_factory=TurnMemory)


def chat_job(req: ChatCompletionRequest, model: str, context_length: int,
             chat: ChatSetup) -> Job:
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    # Unset: generate until eos or the context is full, as OpenAI does.
    params = sampling_params(req, context_length if max_tokens is None else max_tokens)
    _add_response_format(params, req.response_format)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice or ("auto" if tools else "none")
    parser = chat.tool_parser
    if tools and choice != "none" and parser is None:
        raise ValueError("tools: this server has no tool-call parser (start it with "
                         "--tool-call-parser)")
    reads_calls = parser if tools and choice != "none" else None
    if reads_calls is not None:
        _add_tool_grammar(params, parser, tools, choice, req.parallel_tool_calls)
    messages = [{**m.model_dump(exclude_none=True, exclude={"content"}),
                 "content": None if m.content is None else _content(m.content)}
                for m in req.messages]
    ids = render(chat.tokenizer, messages, tools or None, parser, req.chat_template_kwargs,
                 chat.memory)
    kwargs: dict[str, Any] = {"input_ids": ids, "sampling_params": params,
                              "rid": f"{job_id}-0"}
    images = [part.image_url.url for m in req.messages if isinstance(m.content, list)
              for part in m.content if isinstance(part, ImageUrlPart)]
    if images:
        kwargs["image_data"] = images
    top = (req.top_logprobs or 0) if req.logprobs else None
    _add_logprobs(kwargs, top)
    _add_common(kwargs, req)
    return Job(job_id, "chat.completion", req.model or model, req.n, 1, top,
               _include_usage(req), kwargs, tools=reads_calls,
               reasoning=chat.reasoning_parser)


def _add_tool_grammar(params: dict[str, Any], parser: ToolParser, tools: list[dict[str, Any]],
                      choice: Any, parallel: bool) -> None:
    """`required` and a named function: only calls; `auto`: calls that match their schemas
    where the format's markup opens one (left free when a response_format is asked)."""
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t["function"]["name"] == choice.function.name]
        params["ebnf"] = forced_calls_ebnf(parser, named, parallel=False)
    elif choice == "required":
        params["ebnf"] = forced_calls_ebnf(parser, tools, parallel)
    elif "json_schema" not in params:
        params["ebnf"] = auto_calls_ebnf(parser, tools, parallel)


def _add_response_format(params: dict[str, Any], fmt: ResponseFormat | None) -> None:
    """OpenAI's structured output as the engine's json_schema grammar (json_object: any
    JSON object). A schema the grammar cannot compile is a 400 from the engine."""
    if fmt is not None and fmt.type == "json_schema":
        params["json_schema"] = fmt.json_schema.json_schema
    elif fmt is not None and fmt.type == "json_object":
        params["json_schema"] = {"type": "object"}


def _content(content: str | list) -> str | list[dict[str, str]]:
    """A message's content as the chat template reads it: text parts joined, or, with images,
    the parts (an image as {'type': 'image'}: the template writes its placeholder)."""
    if isinstance(content, str):
        return content
    if not any(isinstance(part, ImageUrlPart) for part in content):
        return "".join(part.text for part in content)
    return [{"type": "image"} if isinstance(part, ImageUrlPart)
            else {"type": "text", "text": part.text} for part in content]


def _add_logprobs(kwargs: dict[str, Any], top: int | None) -> None:
    if top is not None:
        kwargs["return_logprob"] = True
        kwargs["top_logprobs_num"] = top


def _add_common(kwargs: dict[str, Any], req: SamplingFields) -> None:
    if req.cache_salt is not None:
        kwargs["cache_salt"] = req.cache_salt
    if req.session_id is not None:
        kwargs["session_id"] = req.session_id


def _include_usage(req: SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


class Formatter:
    """Builds OpenAI response bodies and stream chunks from engine outputs."""

    def __init__(self, decode_token: Callable[[int], str], memory: TurnMemory | None = None):
        self.decode_token = decode_token
        self.memory = memory  # where chat turns' token ids are kept for the next request

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
            choice["message"] = message = self.message(job, out["text"])
            if message.get("tool_calls") and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
            self.remember(message, out["output_ids"], meta)
        else:
            choice["text"] = out["text"]
        choice["logprobs"] = logprobs
        choice["weight_version"] = meta.get("weight_version")
        return choice

    def message(self, job: Job, text: str) -> dict[str, Any]:
        """The assistant message of a chat output: reasoning split off, calls read."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if job.reasoning is not None:
            reasoning, text = job.reasoning.split(text)
            message["content"] = text
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        if job.tools is None:
            return message
        parsed = job.tools.parse(text)
        for error in parsed.errors:
            logger.warning("%s: a tool call did not parse (%s); returned as content: %r",
                           job.id, error.reason, error.text[:200])
        if parsed.tool_calls:
            content = "\n".join(x for x in [parsed.content, *(e.text for e in parsed.errors)]
                                if x)
            message["content"] = content or None
            message["tool_calls"] = [_call_entry(c.name, c.arguments)
                                     for c in parsed.tool_calls]
        return message

    def remember(self, message: dict[str, Any], ids: list[int], meta: dict[str, Any]) -> None:
        """Keep the turn's ids, so the next request that sends this turn back gets them."""
        reason = meta["finish_reason"] or {}
        if self.memory is None or isinstance(reason.get("matched"), str):
            return  # a stop string cut the text short of the ids
        if isinstance(reason.get("matched"), int) and ids and ids[-1] == reason["matched"]:
            ids = ids[:-1]  # the template writes the turn's end itself
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in message.get("tool_calls", [])]
        self.memory.remember(turn_key(message["content"], calls), ids)

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

    def delta_choice(self, job: Job, index: int, event: dict[str, Any],
                     reader: ChatStream | None = None) -> dict[str, Any] | None:
        """The chunk choice for one engine stream event; None when it carries nothing."""
        meta = event["meta_info"]
        delta: dict[str, Any] = {}
        if reader is not None:  # every chat stream has one
            delta = reader.feed(event["text"], event["output_ids"], meta)
        finish = finish_fields(meta)
        if reader is not None and reader.called and finish["finish_reason"] == "stop":
            finish["finish_reason"] = "tool_calls"
        carries = bool(delta) if job.kind == "chat.completion" else bool(event["text"])
        if not carries and finish["finish_reason"] is None and (
                job.top_logprobs is None or not event["output_ids"]):
            return None
        choice: dict[str, Any] = {"index": index}
        if job.kind == "chat.completion":
            choice["delta"] = delta
        else:
            choice["text"] = event["text"]
        choice["logprobs"] = self.logprobs(job, meta, event["output_ids"])
        choice.update(finish)
        return choice

    async def stream(self, job: Job, events: AsyncIterator[dict[str, Any]]
                     ) -> AsyncIterator[dict[str, Any]]:
        """Chunks for an engine event stream; usage last when the client asked for it."""
        index = {rid: i for i, rid in enumerate(job.rids)}
        readers: dict[str, ChatStream] = {}
        if job.kind == "chat.completion":
            yield self.chunk(job, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}
                                   for i in range(len(index))])
            readers = {rid: ChatStream(self, job) for rid in index}
        finals: dict[str, dict[str, Any]] = {}
        async with aclosing(events):
            async for event in events:
                meta = event["meta_info"]
                if meta["finish_reason"] is not None:
                    finals[meta["id"]] = meta
                choice = self.delta_choice(job, index[meta["id"]], event,
                                           readers.get(meta["id"]))
                if choice is not None:
                    yield self.chunk(job, [choice])
        if job.include_usage:
            yield self.chunk(job, [], usage(job, [finals[r] for r in job.rids if r in finals]))


class ChatStream:
    """One streamed chat choice read through the job's parsers: reasoning, content and
    tool-call deltas as they become certain; at the end, the turn is remembered."""

    def __init__(self, formatter: Formatter, job: Job):
        self.formatter, self.job = formatter, job
        self.reasoning = ReasoningStream(job.reasoning) if job.reasoning else None
        self.tools = ToolStream(job.tools) if job.tools else None
        self.text = ""
        self.ids: list[int] = []
        self.called = False  # the turn's calls parsed: finish_reason tool_calls

    def feed(self, text: str, ids: list[int], meta: dict[str, Any]) -> dict[str, Any]:
        self.text += text
        self.ids += ids
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        parts = self.tools.feed(content) if self.tools else [{"content": content}]
        finished = meta["finish_reason"] is not None
        if finished and self.tools is not None:
            parts += self._finish()
        pieces = [p["content"] for p in parts if "content" in p]
        if any(pieces):
            delta["content"] = "".join(pieces)
        calls = [self._call_delta(p) for p in parts if "index" in p]
        if calls:
            delta["tool_calls"] = calls
        if finished:
            message = self.formatter.message(self.job, self.text)
            self.called = bool(message.get("tool_calls"))
            self.formatter.remember(message, self.ids, meta)
        return delta

    def _finish(self) -> list[dict[str, Any]]:
        """What the tool stream held back or could not read as a call, as content."""
        tools = self.tools
        left = tools.text[tools.sent:]
        if tools.mode not in ("content", "done") or not left.strip():
            return []
        return [{"content": left if tools.said else left.lstrip()}]

    def _call_delta(self, part: dict[str, Any]) -> dict[str, Any]:
        if "name" in part:
            return {"index": part["index"], "id": _call_id(), "type": "function",
                    "function": {"name": part["name"], "arguments": ""}}
        return {"index": part["index"], "function": {"arguments": part["arguments"]}}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_entry(name: str, arguments: str) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


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
