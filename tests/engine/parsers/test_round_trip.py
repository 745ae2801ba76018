"""Token in, token out across turns, per tool-call format.

For each format a chat template of its family (written here, in the layout those models'
templates use) renders an assistant turn with tool calls. The tiny model generates a forced call
through the grammar; the call is parsed; the template re-renders the parsed message. Hermes and
Llama-3 templates give back exactly the generated text. Mistral's cannot: its template writes
each call's `id` into the turn, which the model did not generate; the test says so. In every
case the server's path (parsers.chat.render with the turn remembered) gives exactly the ids the
model generated, whatever tokenization the model chose.
"""

from __future__ import annotations

import json

import pytest

from hotswap.engine.parsers import tool_parser
from hotswap.engine.parsers.chat import TurnMemory, render, turn_key
from hotswap.engine.parsers.grammar import forced_calls_ebnf

_TURNS = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{ OPEN_ASSISTANT }}"
    "{%- if m.content %}{{ m.content }}{% endif %}CALLS{{ END }}"
    "{%- elif m.role == 'assistant' %}{{ OPEN_ASSISTANT }}{{ m.content }}{{ END }}"
    "{%- else %}{{ OPEN_ROLE }}{{ m.content }}{{ END }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ OPEN_ASSISTANT }}{%- endif %}")


def _family(open_assistant: str, open_role: str, end: str, calls: str) -> str:
    """A template of one family: its turn markers, and how it writes an assistant's calls."""
    return (_TURNS.replace("OPEN_ASSISTANT", open_assistant).replace("OPEN_ROLE", open_role)
            .replace("END", end).replace("CALLS", calls) + "{# tools #}")


TEMPLATES = {
    "hermes": _family(
        "'<|im_start|>assistant\\n'", "'<|im_start|>' + m.role + '\\n'", "'<|im_end|>\\n'",
        "{%- for c in m.tool_calls %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
        "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
        "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}"),
    "llama3": _family(
        "'<|start_header_id|>assistant<|end_header_id|>\\n\\n'",
        "'<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n'", "'<|eot_id|>'",
        "{%- set c = m.tool_calls[0] %}{\"name\": \"{{ c.function.name }}\", "
        "\"parameters\": {{ c.function.arguments | tojson }}}"),
    "mistral": _family(
        "''", "'[INST] '", "'</s>'",
        "[TOOL_CALLS][{%- for c in m.tool_calls %}{% if not loop.first %}, "
        "{% endif %}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
        "{{ c.function.arguments | tojson }}, \"id\": \"{{ c.id }}\"}{%- endfor %}]"),
}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                     "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["word", "n"]}}}]
ASK = [{"role": "user", "content": "Look up a word."}]


@pytest.fixture
def templated(api_engine):
    tokenizer = api_engine.tokenizer
    plain = tokenizer.chat_template

    def use(name: str):
        tokenizer.chat_template = TEMPLATES[name]
        return tokenizer

    yield use
    tokenizer.chat_template = plain


@pytest.fixture(scope="module")
def api_model_path(tmp_path_factory) -> str:
    from fixtures import write_tiny_chat_model

    return write_tiny_chat_model(str(tmp_path_factory.mktemp("round-trip")),
                                 max_position_embeddings=1024)


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_generated_call_turn_round_trips(api_engine, templated, fmt: str, seed: int) -> None:
    tokenizer = templated(fmt)
    parser = tool_parser(fmt)
    prompt = render(tokenizer, ASK, TOOLS, parser)
    out = api_engine.generate(input_ids=prompt, sampling_params={
        "ebnf": forced_calls_ebnf(parser, TOOLS, parallel=False), "max_new_tokens": 120,
        "temperature": 1.0, "seed": seed})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    ids = out["output_ids"][:-1]  # less the stop token; the template ends the turn itself
    text = tokenizer.decode(ids)
    parsed = parser.parse(text)
    assert parsed.errors == [] and len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]
    assert parser.render(parsed.tool_calls) == text  # the parser's own form is what it read
    message = {"role": "assistant", "content": parsed.content or None, "tool_calls": [
        {"id": "call9abcd", "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]}
    convo = [*ASK, message, {"role": "user", "content": "thanks"}]
    prompt_text = tokenizer.decode(prompt)
    rendered = tokenizer.apply_chat_template(
        [*ASK, {**message, "tool_calls": [{**message["tool_calls"][0], "function": {
            "name": call.name, "arguments": json.loads(call.arguments)}}]},
         {"role": "user", "content": "thanks"}], tokenize=False)
    if fmt == "mistral":  # its template writes the call id the model never generated
        assert not rendered.startswith(prompt_text + text)
        assert '"id": "call9abcd"' in rendered
    else:
        assert rendered.startswith(prompt_text + text)
    # The server's path: the remembered turn's own ids, the next message after them.
    memory = TurnMemory()
    memory.remember(turn_key(message["content"], [(call.name, call.arguments)]), ids)
    again = render(tokenizer, convo, TOOLS, parser, None, memory)
    assert again[:len(prompt) + len(ids)] == prompt + ids
