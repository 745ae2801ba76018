"""Tool-call parsers: the formats RL models write their calls in, read back into calls.

hermes (Qwen too): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.
llama3: `<|python_tag|>{"name": ..., "parameters": {...}}`, or the whole message as such an
object; several calls separated by `;`.
mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "..."}, ...]`.

The JSON is read with a JSON decoder from where the markup opens, never cut out with a regex,
so braces and closing tags inside argument strings stay where they belong. A span that opens
a call but does not parse is an error in `Parsed.errors`, never an empty call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's function.arguments)
    id: str = ""  # the format's own call id where it has one (Mistral), else ""


@dataclass(frozen=True)
class ParseError:
    text: str  # the span that opened a call but did not parse
    reason: str


@dataclass
class Parsed:
    content: str  # the text outside the calls
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)


def make_call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall:
    """A call from a decoded object; ValueError says what is wrong with it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("a call must be an object with a non-empty string 'name'")
    key = next((k for k in args_keys if k in obj), None)
    args = {} if key is None else obj[key]
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            raise ValueError(f"{key!r} is a string that is not JSON") from None
    if not isinstance(args, dict):
        raise ValueError(f"{key!r} must be a JSON object")
    call_id = obj.get("id", "")
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False),
                    call_id if isinstance(call_id, str) else "")


def decode_at(text: str, start: int) -> tuple[Any, int]:
    """The JSON value starting at `start` (after whitespace) and the index just past it."""
    while start < len(text) and text[start].isspace():
        start += 1
    return _DECODER.raw_decode(text, start)


class ToolParser:
    name = ""

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def parse_ids(self, ids: list[int], tokenizer: Any) -> Parsed:
        """The calls in generated token ids: the markup tokens are kept as text, so the same
        reading applies whether or not they are special tokens of the tokenizer."""
        return self.parse(tokenizer.decode(ids, skip_special_tokens=False))


class HermesParser(ToolParser):
    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> Parsed:
        out = Parsed("")
        content: list[str] = []
        pos = 0
        while (start := text.find(self.open, pos)) >= 0:
            content.append(text[pos:start])
            body = start + len(self.open)
            try:
                obj, end = decode_at(text, body)
                call = make_call(obj, ("arguments", "parameters"))
                close = text.find(self.close, end)
                if text[end:close if close >= 0 else len(text)].strip():
                    raise ValueError(f"text after the call's JSON, before {self.close}")
                out.tool_calls.append(call)
                pos = len(text) if close < 0 else close + len(self.close)
            except ValueError as exc:
                close = text.find(self.close, body)
                pos = len(text) if close < 0 else close + len(self.close)
                out.errors.append(ParseError(text[start:pos], str(exc)))
        content.append(text[pos:])
        out.content = "".join(content).strip() if out.tool_calls or out.errors else text
        return out


class Llama3Parser(ToolParser):
    name = "llama3"
    tag = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        tagged = text.find(self.tag)
        if tagged < 0 and not text.lstrip().startswith("{"):
            return Parsed(text)
        start = tagged + len(self.tag) if tagged >= 0 else 0
        head = text[:tagged] if tagged >= 0 else ""
        out = Parsed(head.strip())
        pos = start
        try:
            while True:
                obj, pos = decode_at(text, pos)
                out.tool_calls.append(make_call(obj, ("parameters", "arguments")))
                rest = text[pos:].lstrip()
                if not rest.startswith(";"):
                    break
                pos = len(text) - len(rest) + 1
            if text[pos:].strip():
                raise ValueError("text after the calls")
        except ValueError as exc:
            if tagged < 0 and not out.tool_calls:  # a bare JSON reply that is not a call
                return Parsed(text)
            out.errors.append(ParseError(text[start:], str(exc)))
        return out


class MistralParser(ToolParser):
    name = "mistral"
    tag = "[TOOL_CALLS]"

    def parse(self, text: str) -> Parsed:
        tagged = text.find(self.tag)
        if tagged < 0:
            return Parsed(text)
        out = Parsed(text[:tagged].strip())
        body = tagged + len(self.tag)
        try:
            calls, end = decode_at(text, body)
            calls = calls if isinstance(calls, list) else [calls]
            out.tool_calls = [make_call(c, ("arguments", "parameters")) for c in calls]
            if text[end:].strip():
                raise ValueError("text after the calls")
        except ValueError as exc:
            out.tool_calls = []
            out.errors.append(ParseError(text[tagged:], str(exc)))
        return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "qwen": HermesParser, "llama3": Llama3Parser,
    "mistral": MistralParser}


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own markup asks for, or None."""
    if not chat_template:
        return None
    for mark, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                       ("<|python_tag|>", "llama3"), ("ipython", "llama3")):
        if mark in chat_template:
            return name
    return None
