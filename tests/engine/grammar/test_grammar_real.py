"""Structured output from SmolLM2-135M-Instruct: JSON schemas, regex, choices and EBNF, in-process
and through the official `openai` client (engine/grammar, server response_format)."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import openai
import pytest
from fixtures import serve

from hotswap.engine import Engine

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

# (what to ask for, schema), in increasing difficulty: nested objects, arrays with min/max
# items, enums, bounded numbers, required and optional fields, string patterns.
SCHEMAS = [
    ("a city", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"]}),
    ("a person with name and age", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}),
    ("a traffic light state", {"type": "object", "properties": {
        "color": {"enum": ["red", "yellow", "green"]}, "blinking": {"type": "boolean"}},
        "required": ["color", "blinking"]}),
    ("a shopping list", {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 20},
                  "minItems": 2, "maxItems": 4}}, "required": ["items"]}),
    ("a product with an SKU code and an optional price", {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "note": {"type": "string", "maxLength": 20}},
        "required": ["sku"]}),
    ("a book with author and year", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "author": {"type": "object", "properties": {
            "first": {"type": "string", "maxLength": 20},
            "last": {"type": "string", "maxLength": 20}},
            "required": ["first", "last"]},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2025}},
        "required": ["title", "author", "year"]}),
    ("a weather report for two days", {"type": "object", "properties": {
        "days": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "object", "properties": {
                "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                "temp_c": {"type": "integer", "minimum": -40, "maximum": 50},
                "sky": {"enum": ["sunny", "cloudy", "rain"]}},
            "required": ["day", "temp_c", "sky"]}}},
        "required": ["days"]}),
    ("a tool call", {"type": "object", "properties": {
        "name": {"enum": ["search", "calculator"]},
        "arguments": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 30},
            "digits": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                       "minItems": 1, "maxItems": 3}},
            "required": ["query"]},
        "id": {"type": "string", "pattern": "^call_[a-z0-9]{4}$"}},
        "required": ["name", "arguments", "id"]}),
]


@pytest.fixture(scope="module")
def engine(real_model_path):
    with Engine(real_model_path, max_total_tokens=16384) as eng:
        yield eng


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_json_schemas_every_sample_validates(engine):
    outs = engine.generate(
        messages=[ask(f"Reply with JSON describing {what}.") for what, _ in SCHEMAS],
        sampling_params=[{"json_schema": schema, "n": 4, "temperature": 0.7, "seed": 100 + i,
                          "max_new_tokens": 160} for i, (_, schema) in enumerate(SCHEMAS)])
    assert len(outs) == 4 * len(SCHEMAS)
    for i, out in enumerate(outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
        jsonschema.validate(json.loads(out["text"]), SCHEMAS[i // 4][1])
    assert len({o["text"] for o in outs[-4:]}) > 1  # four samples, not one repeated


ARITHMETIC = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [1-9] [0-9]? | "(" expr ")"
"""


def test_regex_choices_and_ebnf(engine):
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    colors = ["red", "green", "blue"]
    outs = engine.generate(messages=[
        ask("When did the first person walk on the moon? Give the date."),
        ask("What color is the sky on a clear day?"),
        ask("Write an arithmetic expression that equals 10."),
    ], sampling_params=[
        {"regex": date, "temperature": 0, "max_new_tokens": 20},
        {"choices": colors, "temperature": 0, "max_new_tokens": 8},
        {"ebnf": ARITHMETIC, "temperature": 0, "max_new_tokens": 40},
    ])
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs), outs
    assert re.fullmatch(date, outs[0]["text"])
    assert outs[1]["text"] in colors
    tree = ast.parse(outs[2]["text"], mode="eval")  # the EBNF's language is Python-parsable
    assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.operator))
               for n in ast.walk(tree))


def test_openai_client_response_format_gets_valid_json(engine):
    what, schema = SCHEMAS[5]
    with serve(engine) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               timeout=1800)  # a loaded 2-core machine: minutes per request
        chat = client.chat.completions.create(
            model="smollm2", messages=ask(f"Reply with JSON describing {what}."),
            max_tokens=160, temperature=0.7, seed=1,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "book", "schema": schema}})
        completion = client.completions.create(
            model="smollm2", prompt="A JSON record of a person:", max_tokens=80, seed=2,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": "person", "schema": SCHEMAS[1][1]}}})
        with pytest.raises(openai.BadRequestError, match="pattern|regex|invalid grammar"):
            client.chat.completions.create(
                model="smollm2", messages=ask("hi"), max_tokens=4, response_format={
                    "type": "json_schema", "json_schema": {"name": "bad", "schema": {
                        "type": "string", "pattern": "a(b"}}})
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS[1][1])
