"""A chat conversation with tools as prompt tokens, the model's own tokens kept across turns.

`render` gives the template the OpenAI messages in the form chat templates read: tool calls with
their arguments as objects, `tools=` and the caller's template arguments (`enable_thinking`,
...). A template that knows nothing of tools (no `tools` in its text) gets them described in
the system message in the parser's format, and past calls written into the assistant's content
as the parser's markup, so any chat model can be asked.

`TurnMemory` keeps the token ids of assistant turns that were generated here. When a later
request's history holds such a turn, its tokens are those ids, not a re-tokenisation of the
rendered text: a multi-turn conversation through the HTTP API is token in, token out, and the
next turn's prompt starts with exactly the previous prompt and output (prefix cache hits).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from hotswap.engine.parsers.tool_calls import ToolCall, ToolParser

_MARK = "\u2063TURN{}\u2063"
TURNS_KEPT = 4096


def describe_tools(parser: ToolParser, tools: list[dict[str, Any]]) -> str:
    """The system text that offers `tools` to a model whose template does not."""
    example = parser.render([ToolCall("<name>", "{<arguments>}")])
    return ("You may call functions. Their signatures are in <tools></tools>:\n<tools>\n"
            + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + "\n</tools>\n"
            f"To call a function, write:\n{example}")


def turn_key(content: str | None, calls: list[tuple[str, str]]) -> str:
    return json.dumps([content or "", calls], ensure_ascii=False)


class TurnMemory:
    """Generated assistant turns' token ids, by what the turn says (content and calls)."""

    def __init__(self, size: int = TURNS_KEPT):
        self.size = size
        self._ids: OrderedDict[str, list[int]] = OrderedDict()

    def remember(self, key: str, ids: list[int]) -> None:
        self._ids[key] = list(ids)
        self._ids.move_to_end(key)
        while len(self._ids) > self.size:
            self._ids.popitem(last=False)

    def recall(self, key: str) -> list[int] | None:
        ids = self._ids.get(key)
        if ids is not None:
            self._ids.move_to_end(key)
        return ids


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []]


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
           parser: ToolParser | None, template_kwargs: dict[str, Any] | None = None,
           memory: TurnMemory | None = None) -> list[int]:
    """The prompt ids of `messages` (OpenAI dicts, already validated) with the generation
    prompt. ValueError when the template fails on them."""
    template = tokenizer.chat_template or ""
    if not template:
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    knows_tools = "tools" in template
    knows_calls = "tool_calls" in template
    convo: list[dict[str, Any]] = []
    spliced: list[list[int]] = []
    for m in messages:
        known = memory.recall(turn_key(m.get("content"), _calls(m))) if (
            memory is not None and m["role"] == "assistant") else None
        if known is not None:
            convo.append({"role": "assistant", "content": _MARK.format(len(spliced))})
            spliced.append(known)
            continue
        out = {k: v for k, v in m.items() if v is not None}
        out["content"] = m.get("content") or ""
        calls = m.get("tool_calls")
        if calls and knows_calls:
            out["tool_calls"] = [{**c, "function": {
                "name": c["function"]["name"],
                "arguments": json.loads(c["function"]["arguments"])}} for c in calls]
        elif calls:
            out.pop("tool_calls")
            written = parser.render([ToolCall(*c) for c in _calls(m)]) if parser else ""
            out["content"] = "\n".join(x for x in (out["content"], written) if x)
        convo.append(out)
    if tools and not knows_tools and parser is not None:
        offer = describe_tools(parser, tools)
        if convo[0]["role"] == "system":
            convo[0] = {**convo[0], "content": convo[0]["content"] + "\n\n" + offer}
        else:
            convo.insert(0, {"role": "system", "content": offer})
    kwargs = dict(template_kwargs or {})
    if tools and knows_tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True,
                                             **kwargs)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise ValueError(f"messages: the chat template failed on them: {exc}") from None
    ids = _encode_spliced(tokenizer, text, spliced)
    if ids is None:  # the template rewrote a remembered turn: render the messages as sent
        return render(tokenizer, messages, tools, parser, template_kwargs, None)
    return ids


def _encode_spliced(tokenizer: Any, text: str, spliced: list[list[int]]) -> list[int] | None:
    ids: list[int] = []
    for k, turn in enumerate(spliced):
        mark = _MARK.format(k)
        at = text.find(mark)
        if at < 0:
            return None
        ids += tokenizer.encode(text[:at], add_special_tokens=False) + turn
        text = text[at + len(mark):]
    return ids + tokenizer.encode(text, add_special_tokens=False)
