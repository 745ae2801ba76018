"""The OpenAI-compatible routes against the official OpenAI client: the same tokens as the Engine.

The fixtures (a tiny chat model, a server with an API key and an admin key) are in conftest.py.
"""

from __future__ import annotations

import json
import re

import pytest
from fixtures import MESSAGES, PROMPT, fresh, token_logprobs


def test_completion_equals_engine_generate(api_engine, api_client):
    params = {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7}
    want = fresh(api_engine, api_engine.generate, prompt=PROMPT, sampling_params=params,
                 return_logprob=True, top_logprobs_num=2)
    got = fresh(api_engine, api_client.completions.create, model="tiny", prompt=PROMPT,
                max_tokens=12, temperature=0.8, top_p=0.9, seed=7, logprobs=2)
    choice = got.choices[0]
    assert choice.text == want["text"]
    assert choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == pytest.approx(token_logprobs(want))
    assert len(choice.logprobs.tokens) == 12
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert got.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    assert got.usage.completion_tokens == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12


def test_completion_n4_equals_engine_samples(api_engine, api_client):
    params = {"max_new_tokens": 8, "n": 4, "seed": 11}
    want = fresh(api_engine, api_engine.generate, prompt=PROMPT, sampling_params=params)
    got = fresh(api_engine, api_client.completions.create, model="tiny", prompt=PROMPT,
                max_tokens=8, n=4, seed=11)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [o["text"] for o in want]
    assert len({c.text for c in got.choices}) > 1
    assert got.usage.completion_tokens == 32
    assert got.usage.prompt_tokens == want[0]["meta_info"]["prompt_tokens"]


def test_completion_prompt_list_and_token_ids(api_engine, api_client):
    prompts = [PROMPT, "Hello, how are you?"]
    got = fresh(api_engine, api_client.completions.create, model="tiny", prompt=prompts,
                max_tokens=5, n=2, seed=3, temperature=0)
    want = fresh(api_engine, api_engine.generate, prompt=prompts,
                 sampling_params={"max_new_tokens": 5, "n": 2, "seed": 3, "temperature": 0})
    assert [c.text for c in got.choices] == [o["text"] for o in want]
    ids = api_engine.tokenizer.encode(PROMPT)
    by_ids = fresh(api_engine, api_client.completions.create, model="tiny", prompt=ids,
                   max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == want[0]["text"]


def test_stop_string(api_engine, api_client):
    want = fresh(api_engine, api_engine.generate, prompt=PROMPT,
                 sampling_params={"max_new_tokens": 16, "seed": 0})
    stop = re.search(r"[a-z]{2,}", want["text"][2:]).group()
    got = fresh(api_engine, api_client.completions.create, model="tiny", prompt=PROMPT,
                max_tokens=16, seed=0, stop=[stop])
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == want["text"][: want["text"].index(stop)]


def test_chat_equals_engine_generate(api_engine, api_client):
    params = {"max_new_tokens": 10, "temperature": 0.7, "seed": 5}
    want = fresh(api_engine, api_engine.generate, messages=MESSAGES, sampling_params=params,
                 return_logprob=True, top_logprobs_num=3)
    got = fresh(api_engine, api_client.chat.completions.create, model="tiny", messages=MESSAGES,
                max_tokens=10, temperature=0.7, seed=5, logprobs=True, top_logprobs=3)
    choice = got.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want["text"]
    content = choice.logprobs.content
    assert [t.logprob for t in content] == pytest.approx(token_logprobs(want))
    assert all(len(t.top_logprobs) == 3 for t in content)
    tops = want["meta_info"]["output_top_logprobs"]
    assert [x.logprob for t in content for x in t.top_logprobs] == pytest.approx(
        [lp for step in tops for lp, _ in step])
    assert got.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]


def test_chat_content_parts_equal_plain_text(api_engine, api_client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "},
                                          {"type": "text", "text": "how are you?"}]}]
    plain = [{"role": "user", "content": "Hello, how are you?"}]
    a = fresh(api_engine, api_client.chat.completions.create, model="tiny", messages=parts,
              max_tokens=6, temperature=0)
    b = fresh(api_engine, api_client.chat.completions.create, model="tiny", messages=plain,
              max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "json_object"},
])
def test_json_response_format_constrains_chat_and_completions(api_client, api_engine, fmt):
    """The random model's first tokens are a valid start of the JSON the format asks for."""
    import xgrammar as xgr

    schema = fmt["json_schema"]["schema"] if fmt["type"] == "json_schema" else {"type": "object"}
    info = xgr.TokenizerInfo.from_huggingface(api_engine.tokenizer, vocab_size=49152)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema),
                                                             any_whitespace=False)
    chat = api_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                              response_format=fmt)
    completion = api_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                               extra_body={"response_format": fmt})
    for text in (chat.choices[0].message.content, completion.choices[0].text):
        assert text.startswith("{") and xgr.GrammarMatcher(compiled).accept_string(text), text
