"""Tools and reasoning on /v1/chat/completions, driven by the official OpenAI client.

The server's model is the tiny random chat model (conftest.py), with a context long enough for
the tool descriptions. Its ChatML template knows nothing of tools, so the server offers them in
the system message and reads calls in the hermes format. A random model calls tools only when
the grammar makes it: `required` and a named function are constrained, and so is `auto`
wherever the model opens a call.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from fixtures import API_KEY, serve, write_tiny_chat_model

from hotswap.engine.parsers.chat import TurnMemory, render

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["C", "F"]}}, "required": ["city", "days", "unit"]}
CALC = {"type": "object", "properties": {
    "expression": {"type": "string", "pattern": "^[0-9+*-]{1,12}$"},
    "exact": {"type": "boolean"}}, "required": ["expression"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "calculator", "parameters": CALC}}]
SCHEMAS = {"weather": WEATHER, "calculator": CALC}
ASK = [{"role": "user", "content": "What is 12*7, and the weather in Oslo?"}]


@pytest.fixture(scope="module")
def api_model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("chat-tools")),
                                 max_position_embeddings=2048)


@pytest.fixture
def thinking_server(api_engine):
    """A second server on the same engine whose template opens a <think> block itself."""
    tokenizer = api_engine.tokenizer
    plain = tokenizer.chat_template
    tokenizer.chat_template = plain.replace("'<|im_start|>assistant\n'",
                                            "'<|im_start|>assistant\n<think>\n'")
    assert tokenizer.chat_template != plain
    try:
        with serve(api_engine, api_key=API_KEY) as srv:
            yield srv
    finally:
        tokenizer.chat_template = plain


def _client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_sampled_at_temperature_1_all_parse_and_validate(api_client) -> None:
    names = set()
    for seed in range(4):
        got = api_client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, n=50, temperature=1.0, seed=seed, max_tokens=160)
        for choice in got.choices:
            assert choice.finish_reason == "tool_calls", choice.message.content
            assert choice.message.content is None and len(choice.message.tool_calls) == 1
            _check_call(choice.message.tool_calls[0])
            names.add(choice.message.tool_calls[0].function.name)
    assert names == {"weather", "calculator"}  # both tools were chosen: 200 calls, none broken


def test_a_named_function_is_the_one_called(api_client) -> None:
    got = api_client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, n=8, seed=1, max_tokens=160,
        tool_choice={"type": "function", "function": {"name": "calculator"}})
    for choice in got.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "calculator"
        _check_call(call)


def test_parallel_calls_are_each_read(api_client) -> None:
    got = api_client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=16, seed=3,
        max_tokens=400, temperature=1.0)
    counts = []
    for choice in got.choices:
        calls = choice.message.tool_calls or []
        counts.append(len(calls))
        for call in calls:
            _check_call(call)
    assert max(counts) >= 2 and min(counts) >= 1, counts


def test_streamed_call_deltas_concatenate_to_the_call(api_client) -> None:
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, seed=11, max_tokens=160, temperature=1.0)
    whole = api_client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    pieces = 0
    for chunk in api_client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index not in calls
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "args": ""}
                assert delta.function.arguments == ""
            else:
                calls[delta.index]["args"] += delta.function.arguments
                pieces += 1
    assert finish == "tool_calls" == whole.finish_reason
    [want] = whole.message.tool_calls
    assert [(c["name"], c["args"]) for c in calls.values()] == [
        (want.function.name, want.function.arguments)]
    assert pieces > 3  # the arguments came in pieces, as generated


def test_a_tool_result_goes_back_and_the_next_turn_reuses_the_model_tokens(api_client) -> None:
    first = api_client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, seed=5, max_tokens=160,
        tool_choice={"type": "function", "function": {"name": "weather"}})
    [call] = first.choices[0].message.tool_calls
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = api_client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                                tool_choice="none", max_tokens=8, seed=5)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # Token in, token out: the prompt starts with exactly the first prompt and the generated
    # tokens (less the end token the template writes), so the prefix cache holds all of them.
    done = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == done


def test_tool_choice_none_and_auto(api_client) -> None:
    none = api_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                              tool_choice="none", max_tokens=12, seed=2)
    assert none.choices[0].message.tool_calls is None
    auto = api_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, n=16,
                                              max_tokens=96, seed=2, temperature=1.0)
    for choice in auto.choices:
        for call in choice.message.tool_calls or []:
            _check_call(call)  # under auto, a call that opens matches its schema


def test_reasoning_is_separated_in_the_message_and_the_stream(thinking_server) -> None:
    client = _client(thinking_server)
    kwargs = dict(model="tiny", messages=ASK, max_tokens=40, seed=4,
                  extra_body={"regex": "[a-z]{3,8} [a-z]{3,8}</think>\n\n[A-Z][a-z]{3,8}"})
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert len(reasoning.split(" ")) == 2 and "<think>" not in reasoning
    assert message.content[0].isupper() and "</think>" not in message.content
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        streamed["content"] += delta.content or ""
        streamed["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == {"reasoning_content": reasoning, "content": message.content}
    info = json.loads(_get(thinking_server, "/get_server_info"))
    assert (info["tool_call_parser"], info["reasoning_parser"]) == ("hermes", "think")


def _get(server, path: str) -> str:
    import httpx

    return httpx.get(server.url + path, headers={"Authorization": f"Bearer {API_KEY}"}).text


def _call(call_id: str = "call_1", name: str = "weather", args: str = '{"city": "Oslo"}'):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [_call()]}
MALFORMED = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "type"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "same name"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "array"}}}]},
     "parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}],
      "tool_choice": "required"}, "parameters"),
    ({"tools": "weather"}, "tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "content": "21 C"}]}, "tool_call_id"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "21 C"}]},
     "tool_call_id"),
    ({"messages": [*ASK, ASSISTANT_CALL,
                   {"role": "tool", "tool_call_id": "call_2", "content": "x"}]},
     "tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [_call(args="{oops")]}]},
     "arguments"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [_call(args="[1, 2]")]}]},
     "arguments"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [_call(args={"city": "x"})]}]},
     "arguments"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [_call(), _call()]}]},
     "used twice"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [_call()]}]}, "tool_calls"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "call_1"}]},
     "tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant"}]}, "content"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]}, "name"),
    ({"messages": [{"role": "user", "content": "hi", "reasoning_content": "hmm"}]},
     "reasoning_content"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"regex": "[a-z]+"}, "regex"),
]


@pytest.mark.parametrize("change,field", MALFORMED, ids=[f for _, f in MALFORMED])
def test_a_malformed_tools_body_is_a_400_naming_the_field(api_user, change, field) -> None:
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    got = api_user.post("/v1/chat/completions", json=body)
    assert got.status_code == 400, got.text
    assert field in got.json()["error"]["message"], got.json()
    ok = api_user.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK,
                                                     "max_tokens": 2})
    assert ok.status_code == 200  # the server keeps serving


def test_render_keeps_the_model_tokens_of_a_remembered_turn(api_engine) -> None:
    tokenizer = api_engine.tokenizer
    memory = TurnMemory()
    from hotswap.engine.parsers import tool_parser

    first = render(tokenizer, ASK, TOOLS, tool_parser("hermes"), None, memory)
    generated = [5, 6, 7, 8]  # any ids: a tokenization the tokenizer would not choose
    memory.remember('["hi", []]', generated)
    again = render(tokenizer, [*ASK, {"role": "assistant", "content": "hi"},
                               {"role": "user", "content": "and?"}],
                   TOOLS, tool_parser("hermes"), None, memory)
    assert again[:len(first)] == first  # ... up to the assistant turn's generation prompt,
    assert again[len(first):len(first) + len(generated)] == generated  # then its own ids


def test_a_streamed_turn_is_remembered_too(api_client) -> None:
    text, usage = "", None
    for chunk in api_client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=12, seed=8, stream=True,
            stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    history = [*ASK, {"role": "assistant", "content": text}, {"role": "user", "content": "ok"}]
    second = api_client.chat.completions.create(model="tiny", messages=history, max_tokens=2)
    # Every token but the last, whose KV no forward computed, is served from the cache.
    done = usage.prompt_tokens + usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == done
