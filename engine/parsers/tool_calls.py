"""Tool-call parsers: the formats RL models write their calls in, read back into calls.

hermes (Qwen too): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.
llama3: `<|python_tag|>{"name": ..., "parameters": {...}}`, or the whole message as such an
object; several calls separated by `;`.
mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "..."}, ...]`.

The JSON is read with a JSON decoder from where the markup opens, never cut out with a regex,
so braces and closing tags inside argument strings stay where they belong. A span that opens
a call but does not parse is an error in `Parsed.errors`, never an empty call. A call's
arguments are the object's text as the model wrote it, so what a stream sent piece by piece
(streaming.py) and what the re-rendered turn holds are the model's own characters.

`ObjectScanner` reads one call object's structure as its text grows: streaming.py follows calls
with it, and here it finds where the arguments are written. Each parser also knows its markup:
`render` writes calls the way the format does (the text a template without tool support gets
in the assistant turn), and `begin`/`end`/`sep`/`opening`/`closing` are the literal pieces
around each call's arguments that grammar.py constrains.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
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


def make_call(obj: Any, args_keys: tuple[str, ...], text: str = "", start: int = 0
              ) -> ToolCall:
    """A call from a decoded object (read from text[start:]); ValueError says what is wrong
    with it. Arguments written as an object keep their text; as a JSON string, normalised."""
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
    span = (args_span(text, start, args_keys)
            if text and key is not None and isinstance(obj[key], dict) else None)
    arguments = text[span[0]:span[1]] if span else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], arguments, call_id if isinstance(call_id, str) else "")


def args_span(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[int, int] | None:
    """Where the arguments object of the (valid) call object at text[start:] is written."""
    scan = ObjectScanner(args_keys)
    scan.feed(text, start)
    return (scan.args_start, scan.args_end) if scan.args_end >= 0 else None


def decode_at(text: str, start: int) -> tuple[Any, int]:
    """The JSON value starting at `start` (after whitespace) and the index just past it."""
    while start < len(text) and text[start].isspace():
        start += 1
    return _DECODER.raw_decode(text, start)


class ObjectScanner:
    """Reads one JSON object as its text grows: where it ends, its string "name", and where its
    arguments value (under one of `args_keys`) starts and ends. It checks structure only;
    the full parser validates the finished object."""

    def __init__(self, args_keys: tuple[str, ...]):
        self.args_keys = args_keys
        self.start = self.pos = -1
        self.depth = 0
        self.in_string = self.escaped = False
        self.string_start = -1
        self.expect = "object"  # object | key | colon | value | next (at depth 1)
        self.key: str | None = None
        self.value_key: str | None = None  # the depth-1 key whose value is being read
        self.name: str | None = None
        self.args_start = self.args_end = -1
        self.args_is_object = False
        self.end = -1  # just past the closing brace, once read
        self.failed = False

    @property
    def done(self) -> bool:
        return self.end >= 0

    def feed(self, text: str, start: int | None = None) -> None:
        if self.pos < 0:
            self.start = self.pos = start or 0
        while self.pos < len(text) and not (self.done or self.failed):
            self._step(text, text[self.pos])
            self.pos += 1

    def _step(self, text: str, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_done(json.loads(text[self.string_start:self.pos + 1]))
            return
        if ch.isspace():
            return
        if self.expect == "object":
            if ch != "{":
                self.failed = True
                return
            self.depth, self.expect = 1, "key"
            return
        if ch == '"':
            self.in_string, self.string_start = True, self.pos
            if self.depth == 1 and self.expect == "value":
                self._value_starts(is_object=False)
            return
        if self.depth == 1:
            self._depth1(ch)
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.value_key in self.args_keys and self.args_end < 0:
                self.args_end = self.pos + 1
                self.expect = "next"

    def _depth1(self, ch: str) -> None:
        if self.expect == "colon" and ch == ":":
            self.expect = "value"
        elif self.expect == "value":
            self._value_starts(is_object=ch == "{")
            if ch in "{[":
                self.depth += 1
            else:
                self.expect = "next"  # a number, true, false or null
        elif ch == ",":
            self.expect = "key"
        elif ch == "}":
            self.depth, self.end = 0, self.pos + 1

    def _value_starts(self, is_object: bool) -> None:
        self.value_key = self.key
        if self.key in self.args_keys and self.args_start < 0:
            self.args_start, self.args_is_object = self.pos, is_object

    def _string_done(self, value: str) -> None:
        if self.expect == "key":
            self.key, self.expect = value, "colon"
        else:
            if self.value_key == "name":
                self.name = value
            self.expect = "next"


class ToolParser(ABC):
    name = ""
    args_key = "arguments"  # the key render and grammar.py write the arguments under
    opening = closing = ""  # around all of a turn's calls
    sep = "\n"  # between calls
    call_open = close_tag = ""  # before and after each call's object (its tags)
    triggers: tuple[str, ...] = ()  # text that opens calls in free text (streaming.py)

    @abstractmethod
    def parse(self, text: str) -> Parsed:
        """The calls in a turn's text, the content around them, and what did not parse."""

    def begin(self, name: str) -> str:
        """The text of a call up to its arguments object."""
        return self.call_open + "{" + f'"name": {json.dumps(name, ensure_ascii=False)}, ' \
            f'"{self.args_key}": '

    @property
    def end(self) -> str:
        """The text of a call after its arguments object."""
        return "}" + self.close_tag

    def render(self, calls: list[ToolCall]) -> str:
        """The calls as this format writes them (the form grammar.py makes the model write)."""
        return self.opening + self.sep.join(
            self.begin(c.name) + c.arguments + self.end for c in calls) + self.closing

    def parse_ids(self, ids: list[int], tokenizer: Any) -> Parsed:
        """The calls in generated token ids: the markup tokens are kept as text, so the same
        reading applies whether or not they are special tokens of the tokenizer."""
        return self.parse(tokenizer.decode(ids, skip_special_tokens=False))


class HermesParser(ToolParser):
    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"
    call_open, close_tag, sep = "<tool_call>\n", "\n</tool_call>", "\n"
    triggers = ("<tool_call>",)

    def parse(self, text: str) -> Parsed:
        out = Parsed("")
        content: list[str] = []
        pos = 0
        while (start := text.find(self.open, pos)) >= 0:
            content.append(text[pos:start])
            body = start + len(self.open)
            try:
                obj, end = decode_at(text, body)
                call = make_call(obj, ("arguments", "parameters"), text, body)
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
    args_key, sep = "parameters", "; "
    triggers = ("<|python_tag|>",)  # and a message that opens with "{" (streaming.py)

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
                at = pos
                obj, pos = decode_at(text, pos)
                out.tool_calls.append(make_call(obj, ("parameters", "arguments"), text, at))
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
    opening, closing, sep = "[TOOL_CALLS][", "]", ", "
    triggers = ("[TOOL_CALLS]",)

    def parse(self, text: str) -> Parsed:
        tagged = text.find(self.tag)
        if tagged < 0:
            return Parsed(text)
        out = Parsed(text[:tagged].strip())
        body = tagged + len(self.tag)
        try:
            calls, end = decode_at(text, body)
            out.tool_calls = _list_calls(text, body, calls)
            if text[end:].strip():
                raise ValueError("text after the calls")
        except ValueError as exc:
            out.tool_calls = []
            out.errors.append(ParseError(text[tagged:], str(exc)))
        return out


def _list_calls(text: str, body: int, calls: Any) -> list[ToolCall]:
    """The calls of a decoded `[...]` (or single object) at text[body:], with their spans."""
    if not isinstance(calls, list):
        return [make_call(calls, ("arguments", "parameters"), text, body)]
    out, pos = [], text.index("[", body) + 1
    for call in calls:
        while text[pos].isspace() or text[pos] == ",":
            pos += 1
        _, end = decode_at(text, pos)
        out.append(make_call(call, ("arguments", "parameters"), text, pos))
        pos = end
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
