"""The incremental forms of the parsers, for streamed responses.

`ToolStream` takes a turn's text as it grows and says, as early as it is certain, what is
content, when a call's name is known, and each new piece of its arguments (the model's own
characters, so the pieces concatenate to the final call's `arguments`). `ReasoningStream`
splits a growing text at the `<think>` block. Neither ever takes back what it said: text that
may still turn out to open a call or close the block is held back until it is decided. When a
stream ends, the caller parses the whole text with the full parser, which decides what the
turn's calls and errors are.
"""

from __future__ import annotations

import json
from typing import Any

from hotswap.engine.parsers.reasoning import ReasoningParser
from hotswap.engine.parsers.tool_calls import ObjectScanner, ToolParser, make_call


class ToolStream:
    """One streamed turn read through a tool parser. `feed` returns events: {"content": text},
    {"index": i, "name": n} once a call's name is known, then {"index": i, "arguments": piece}."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # content sent up to here, or the calls read up to here
        self.calls = 0  # calls announced
        self.said = False  # any content sent
        # content | calls (after a trigger) | closing (before an end tag) | done (no more calls)
        self.mode = "content"
        self.expect_list = False  # a trigger that opens a list of calls was just read
        self.scan: ObjectScanner | None = None
        self.args_sent = -1
        self.list_open = parser.opening.endswith("[")
        self.sep = parser.sep.strip()  # "" when each call has its own trigger (hermes)
        self.close_tag = parser.close_tag.strip()
        self.keys = ("arguments", "parameters")

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        events: list[dict[str, Any]] = []
        while self._advance(events):
            pass
        return events

    def _advance(self, events: list[dict[str, Any]]) -> bool:
        """One move; True when another may follow."""
        if self.mode == "content":
            return self._content(events)
        if self.mode == "calls":
            return self._calls(events)
        if self.mode == "closing":  # after a call's object, before its end tag
            close = self.text.find(self.close_tag, self.sent)
            if close >= 0:
                self.sent, self.mode = close + len(self.close_tag), "content"
            return close >= 0
        return False

    def _content(self, events: list[dict[str, Any]]) -> bool:
        text, at = self.text, self.sent
        if self.parser.name == "llama3" and not text[:at].strip():
            head = text[at:].lstrip()
            if head.startswith("{"):  # a message that is a bare call object
                self.sent, self.mode = len(text) - len(head), "calls"
                return True
            if not head:
                return False
        hits = [(text.find(t, at), t) for t in self.parser.triggers]
        hits = [(i, t) for i, t in hits if i >= 0]
        if hits:
            i, trigger = min(hits)
            self._say(events, text[at:i].rstrip())
            self.sent, self.mode = i + len(trigger), "calls"
            self.expect_list = self.list_open
            return True
        held = max((k for t in self.parser.triggers for k in range(1, len(t))
                    if text.endswith(t[:k])), default=0)
        ready = text[at:len(text) - held]
        ready = ready[:len(ready.rstrip())]  # whitespace waits: it may precede a call
        self._say(events, ready)
        self.sent = at + len(ready)
        return False

    def _say(self, events: list[dict[str, Any]], content: str) -> None:
        """Content as the full parser gives it: no whitespace before the first piece or
        around calls."""
        if not self.said:
            content = content.lstrip()
        if content:
            events.append({"content": content})
            self.said = True

    def _calls(self, events: list[dict[str, Any]]) -> bool:
        text = self.text
        if self.scan is None:
            rest = text[self.sent:]
            head = rest.lstrip()
            if not head:
                return False
            skip = len(rest) - len(head)
            if self.expect_list:
                if head[0] != "[":
                    self.mode = "done"
                    return False
                self.expect_list = False
                self.sent += skip + 1
                return True
            if self.sep and head[0] in (self.sep, "]"):
                self.sent += skip + 1
                if head[0] == "]":
                    self.mode = "done"
                return True
            self.scan = ObjectScanner(self.keys)
            self.scan.feed(text, self.sent + skip)
        else:
            self.scan.feed(text)
        scan = self.scan
        if scan.failed:
            self.mode = "done"  # not a call: the full parser reports it at the end
            return False
        if scan.name is not None and self.args_sent < 0:
            events.append({"index": self.calls, "name": scan.name})
            self.args_sent = 0
        if self.args_sent >= 0 and scan.args_start >= 0 and scan.args_is_object:
            upto = scan.args_end if scan.args_end >= 0 else scan.pos
            start = max(scan.args_start, self.args_sent)
            if upto > start:
                events.append({"index": self.calls, "arguments": text[start:upto]})
                self.args_sent = upto
        if not scan.done:
            return False
        return self._call_done(events, scan)

    def _call_done(self, events: list[dict[str, Any]], scan: ObjectScanner) -> bool:
        text = self.text
        if self.args_sent < 0:  # no name: the full parser reports the call
            self.mode = "done"
            return False
        if scan.args_start < 0 or not scan.args_is_object:
            try:  # arguments missing or written as a JSON string: the normalised object
                call = make_call(json.loads(text[scan.start:scan.end]), self.keys)
                events.append({"index": self.calls, "arguments": call.arguments})
            except ValueError:
                pass
        self.calls += 1
        self.scan, self.args_sent, self.sent = None, -1, scan.end
        if self.close_tag:  # one call per trigger: back to content after the end tag
            close = text.find(self.close_tag, self.sent)
            if close < 0:
                self.mode = "closing"
                return False
            self.sent, self.mode = close + len(self.close_tag), "content"
        return True


class ReasoningStream:
    """A growing text split at the reasoning block: `feed` returns (reasoning, content)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.mode = "reasoning" if parser.opens_itself else "start"
        self.after_block = False
        self.reasoned = False  # any reasoning sent

    def _reasoning(self, text: str) -> str:
        """As split(): no whitespace around the block's text."""
        if not self.reasoned:
            text = text.lstrip()
            self.reasoned = bool(text)
        return text

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        reasoning = content = ""
        open_, close = self.parser.open, self.parser.close
        if self.mode == "start":
            head = self.text.lstrip()
            if head.startswith(open_):
                self.sent, self.mode = len(self.text) - len(head) + len(open_), "reasoning"
            elif open_.startswith(head):
                return "", ""  # may still open the block
            else:
                self.mode = "content"
        if self.mode == "reasoning":
            end = self.text.find(close, self.sent)
            if end >= 0:
                reasoning = self._reasoning(self.text[self.sent:end].rstrip())
                self.sent, self.mode, self.after_block = end + len(close), "content", True
            else:
                held = max((k for k in range(1, len(close)) if self.text.endswith(close[:k])),
                           default=0)
                ready = self.text[self.sent:len(self.text) - held]
                ready = ready[:len(ready.rstrip())]  # whitespace waits: it may end the block
                self.sent += len(ready)
                return self._reasoning(ready), ""
        if self.mode == "content":
            content = self.text[self.sent:]
            if self.after_block:  # as split(): the content starts after the block's newlines
                content = content.lstrip()
                self.after_block = not content
            self.sent = len(self.text)
        return reasoning, content


__all__ = ["ReasoningStream", "ToolStream"]
