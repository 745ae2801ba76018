"""The tool-call parsers: every format's calls read back exactly, and what does not parse is an
error the caller sees, never an empty call."""

from __future__ import annotations

import json

import pytest

from hotswap.engine.parsers import detect_tool_parser, tool_parser

NESTED = {"query": {"filters": [{"field": "a}b", "op": "</tool_call>"}], "limit": 3},
          "note": "brace } and \"quote\""}


def hermes(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_hermes_reads_several_calls_with_nested_arguments_and_keeps_the_content() -> None:
    text = "Let me look.\n" + hermes("search", NESTED) + "\n" + hermes("calc", {"x": 1})
    got = tool_parser("hermes").parse(text)
    assert [c.name for c in got.tool_calls] == ["search", "calc"]
    assert json.loads(got.tool_calls[0].arguments) == NESTED  # every closing brace kept
    assert json.loads(got.tool_calls[1].arguments) == {"x": 1}
    assert got.content == "Let me look." and got.errors == []


@pytest.mark.parametrize("bad,reason", [
    ('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', "Expecting"),
    ('<tool_call>{"arguments": {}}</tool_call>', "name"),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "object"),
    ('<tool_call>{"name": "f"} trailing</tool_call>', "text after"),
    ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', "not JSON"),
])
def test_hermes_reports_a_call_that_does_not_parse(bad: str, reason: str) -> None:
    got = tool_parser("qwen").parse("before " + bad + " " + hermes("ok", {}))
    assert [c.name for c in got.tool_calls] == ["ok"]
    assert len(got.errors) == 1 and reason in got.errors[0].reason
    assert got.errors[0].text == bad


def test_hermes_takes_a_call_cut_at_its_closing_tag_and_text_without_calls() -> None:
    got = tool_parser("hermes").parse('<tool_call>{"name": "f", "arguments": {"a": "}"}}')
    assert got.tool_calls[0].name == "f" and json.loads(got.tool_calls[0].arguments) == {"a": "}"}
    plain = tool_parser("hermes").parse("  just an answer: {not a call}  ")
    assert plain.tool_calls == [] and plain.errors == []
    assert plain.content == "  just an answer: {not a call}  "


def test_llama3_reads_tagged_bare_and_several_calls() -> None:
    p = tool_parser("llama3")
    tagged = p.parse('<|python_tag|>{"name": "f", "parameters": ' + json.dumps(NESTED) + "}")
    assert tagged.tool_calls[0].name == "f"
    assert json.loads(tagged.tool_calls[0].arguments) == NESTED
    two = p.parse('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert [c.name for c in two.tool_calls] == ["a", "b"] and two.content == ""
    answer = p.parse('{"answer": 42}')  # JSON that is not a call is the model's content
    assert answer.tool_calls == [] and answer.errors == [] and answer.content == '{"answer": 42}'
    broken = p.parse('<|python_tag|>{"name": "f", "parameters": {')
    assert broken.tool_calls == [] and len(broken.errors) == 1


def test_mistral_reads_its_call_list_with_ids() -> None:
    calls = [{"name": "f", "arguments": NESTED, "id": "abcDEF123"},
             {"name": "g", "arguments": {}, "id": "XYZxyz789"}]
    got = tool_parser("mistral").parse("Sure. [TOOL_CALLS]" + json.dumps(calls))
    assert [(c.name, c.id) for c in got.tool_calls] == [("f", "abcDEF123"), ("g", "XYZxyz789")]
    assert json.loads(got.tool_calls[0].arguments) == NESTED and got.content == "Sure."
    bad = tool_parser("mistral").parse('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"x": 1}]')
    assert bad.tool_calls == [] and "name" in bad.errors[0].reason


def test_parse_ids_reads_the_markup_tokens_too() -> None:
    class Tok:
        vocab = {0: "<tool_call>", 1: '{"name": "f", "arguments": {}}', 2: "</tool_call>"}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.vocab[i] for i in ids)

    assert tool_parser("hermes").parse_ids([0, 1, 2], Tok()).tool_calls[0].name == "f"


def test_parsers_are_chosen_by_name_or_from_the_template() -> None:
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("nope")
    assert detect_tool_parser("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_parser("<|start_header_id|>ipython<|end_header_id|>") == "llama3"
    assert detect_tool_parser("{{ messages }}") is None and detect_tool_parser(None) is None
