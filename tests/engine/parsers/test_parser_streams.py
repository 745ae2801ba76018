"""The incremental parsers: whatever the chunking, the streamed pieces add up to what the full
parser reads, and nothing said is taken back."""

from __future__ import annotations

import json

import pytest

from hotswap.engine.parsers import ReasoningParser, ToolCall, tool_parser
from hotswap.engine.parsers.streaming import ReasoningStream, ToolStream

CALLS = [ToolCall("search", json.dumps({"q": 'a}b "x" </tool_call>', "n": [1, {"k": 2}]})),
         ToolCall("calc", '{"e": "1+2"}')]


def _stream(fmt: str, text: str, step: int) -> tuple[str, list[str], dict[int, str]]:
    stream = ToolStream(tool_parser(fmt))
    events = []
    for i in range(0, len(text), step):
        events += stream.feed(text[i:i + step])
    names = [e["name"] for e in events if "name" in e]
    args: dict[int, str] = {}
    for e in events:
        if "arguments" in e:
            assert e["index"] < len(names)  # a call's name comes before its arguments
            args[e["index"]] = args.get(e["index"], "") + e["arguments"]
    return "".join(e.get("content", "") for e in events), names, args


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streamed_calls_add_up_to_the_parsed_calls(fmt: str, step: int) -> None:
    lead = "" if fmt == "llama3" else "Let me check. "
    text = lead + tool_parser(fmt).render(CALLS)
    content, names, args = _stream(fmt, text, step)
    whole = tool_parser(fmt).parse(text)
    assert whole.errors == [] and whole.tool_calls == CALLS
    assert names == [c.name for c in CALLS]
    assert [args[i] for i in range(len(CALLS))] == [c.arguments for c in CALLS]
    assert content == whole.content


def test_content_without_calls_streams_and_holds_back_only_a_possible_tag() -> None:
    stream = ToolStream(tool_parser("hermes"))
    assert stream.feed("The answer is 4. <tool") == [{"content": "The answer is 4."}]
    assert stream.feed("tip> not a tag") == [{"content": " <tooltip> not a tag"}]


def test_arguments_written_as_a_string_come_out_normalised() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    _, names, args = _stream("hermes", text, 3)
    assert names == ["f"] and args == {0: '{"a": 1}'}
    assert tool_parser("hermes").parse(text).tool_calls[0].arguments == '{"a": 1}'


@pytest.mark.parametrize("text,opens", [
    ("<think>\nadd 2 and 2 </thi</think>\n\nIt is 4.", False),
    ("add 2 and 2</think>It is <think>4</think>.", True),
    ("It is 4, no thinking.", False),
    ("<think>still thinking", False),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_reasoning_adds_up_to_the_split(text: str, opens: bool, step: int) -> None:
    parser = ReasoningParser(opens_itself=opens)
    stream = ReasoningStream(parser)
    parts = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)]
    reasoning, content = parser.split(text)
    assert "".join(r for r, _ in parts) == (reasoning or "")
    assert "".join(c for _, c in parts) == content
