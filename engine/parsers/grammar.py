"""Grammars that make tool calls parse: a parser's markup around each tool's parameter schema.

`required`: the turn is one call (or, with parallel calls, one or more) of any tool; a named
function: exactly one call of it. `auto` (where the format opens its calls with a tag): free
text until a tag, then a call that matches its schema (xgrammar's triggered structural tags).
The arguments are JSON with xgrammar's fixed separators (", " and ": "), the layout `render`
writes, so a constrained turn re-renders to its own text.

The result is EBNF text: the engine's `ebnf` sampling parameter takes it, compiles it once and
caches it like any other grammar.
"""

from __future__ import annotations

import json
from typing import Any

from hotswap.engine.parsers.tool_calls import ToolParser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def _tag(parser: ToolParser, tool: dict[str, Any], before: str = "", after: str = ""
         ) -> dict[str, Any]:
    """One call of `tool`: its markup, then arguments that match its schema (no free
    whitespace: xgrammar's JSON grammar with fixed separators)."""
    import xgrammar as xgr

    name = tool["function"]["name"]
    try:
        schema = xgr.Grammar.from_json_schema(json.dumps(_schema(tool)), any_whitespace=False,
                                              strict_mode=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"tools: function {name!r}: parameters is not a JSON schema the "
                         f"grammar can compile: {exc}") from None
    return {"type": "tag", "begin": before + parser.begin(name),
            "content": {"type": "grammar", "grammar": _no_control_chars(str(schema))},
            "end": parser.end + after}


# xgrammar 0.2.9 writes the characters of a string with a length bound (minLength/maxLength)
# as this class, which lets control characters through; JSON does not allow them unescaped.
_BOUNDED_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _no_control_chars(ebnf: str) -> str:
    return ebnf.replace(_BOUNDED_CHARS, _JSON_CHARS)


def _ebnf(fmt: dict[str, Any]) -> str:
    import xgrammar as xgr

    return str(xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag",
                                                           "format": fmt})))


def forced_calls_ebnf(parser: ToolParser, tools: list[dict[str, Any]], parallel: bool) -> str:
    """One call of any of `tools` (one or more with `parallel`), and nothing else. ValueError
    names a tool whose parameters are not a schema the grammar can compile."""
    calls = {"type": "tags_with_separator", "tags": [_tag(parser, t) for t in tools],
             "separator": parser.sep, "at_least_one": True, "stop_after_first": not parallel}
    parts = [{"type": "const_string", "value": parser.opening}] if parser.opening else []
    parts.append(calls)
    parts += [{"type": "const_string", "value": parser.closing}] if parser.closing else []
    return _ebnf({"type": "sequence", "elements": parts})


def auto_calls_ebnf(parser: ToolParser, tools: list[dict[str, Any]], parallel: bool) -> str:
    """Free text, and a call that matches its schema wherever the format's markup opens one
    (a format whose calls sit in one list, Mistral's, gets one call)."""
    trigger = parser.triggers[0] if parser.triggers else ""
    tags = [_tag(parser, t, parser.opening, parser.closing) for t in tools]
    if not tags[0]["begin"].startswith(trigger):
        trigger = parser.begin("")[:parser.begin("").index('"name": ') + len('"name": "')]
    return _ebnf({"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                  "at_least_one": False, "stop_after_first": not parallel or bool(parser.opening)})
