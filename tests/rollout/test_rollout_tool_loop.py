"""ToolLoop: token-delta templating, masks, behaviour logprobs vs a teacher-forced HF forward."""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from hotswap.engine import Engine
from hotswap.rollout import TokenClient, ToolLoop, hermes_tool_calls

MESSAGES = [{"role": "user", "content": "What is 17 * 23? Use the calculator."}]


@pytest.fixture(scope="module")
def engine(tiny_chat_model_path):
    with Engine(tiny_chat_model_path, device="cpu", dtype="float32",
                max_total_tokens=8192) as eng:
        yield eng


def test_hermes_parser():
    text = ('Let me call <tool_call>{"name": "mul", "arguments": {"a": 2, "b": 3}}</tool_call>'
            " and <tool_call>{broken</tool_call>")
    calls = hermes_tool_calls(text)
    assert calls[0] == ("mul", {"a": 2, "b": 3})
    assert calls[1][0] == "" and "could not parse" in calls[1][1]
    assert hermes_tool_calls("no calls here") == []


def test_tool_errors_and_timeouts_go_back_to_the_model_as_text():
    loop = ToolLoop({"mul": lambda a, b: a * b, "boom": lambda: 1 / 0,
                     "slow": lambda: time.sleep(5)}, tool_timeout_s=0.2)
    assert loop.run_tool("mul", {"a": 6, "b": 7}) == "42"
    assert "ZeroDivisionError" in loop.run_tool("boom", {})
    assert "timed out" in loop.run_tool("slow", {})
    assert "unknown tool 'nope'" in loop.run_tool("nope", {})


def always_calls(text: str):
    """A random model writes no tool calls; this parser makes every turn call one."""
    return [("mul", {"a": 17, "b": 23})]


def test_tool_loop_logprobs_masks_and_rendering(engine, tiny_chat_model_path):
    loop = ToolLoop({"mul": lambda a, b: {"product": a * b}}, max_turns=3, parse=always_calls,
                    max_new_tokens=5)
    client = TokenClient(engine, sampling={"temperature": 1.0})
    trajs = loop.run_group(client, {"messages": MESSAGES}, 2, group_id=0, seed=1)
    tok = engine.tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_model_path,
                                                           dtype=torch.float32).eval()
    tool_ids = loop.deltas(tok).messages([{"role": "tool", "content": '{"product": 391}'}])
    for traj in trajs:
        assert traj.finish_reason == "max_turns" and traj.num_turns == 3
        assert [m["role"] for m in traj.messages] == [
            "user", "assistant", "tool", "assistant", "tool", "assistant"]
        # the whole sequence decodes to exactly what the template renders for the conversation
        full = tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
        assert full == tok.apply_chat_template(traj.messages, tokenize=False)
        # tool messages and closing tokens are masked; generated tokens are not
        mask = traj.loss_mask
        assert len(_turn_outputs(traj)) == 3  # one trainable run per assistant turn
        joined = traj.response_ids
        for start in _find_all(joined, tool_ids):
            assert mask[start: start + len(tool_ids)] == [0] * len(tool_ids)
        assert len(_find_all(joined, tool_ids)) == 2
        # behaviour logprobs == teacher-forced HF forward on the same tokens (fp32)
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0].float()
        p = len(traj.prompt_ids)
        ref = torch.log_softmax(logits[p - 1: -1], -1).gather(
            1, torch.tensor(traj.response_ids)[:, None])[:, 0]
        m = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(traj.logprobs)[m], ref[m], atol=1e-4, rtol=0)
        assert all(lp == 0.0 for lp, k in zip(traj.logprobs, mask) if not k)


def test_token_budget_ends_with_max_tokens(engine):
    loop = ToolLoop({"mul": lambda a, b: a * b}, max_turns=8, max_tokens=40,
                    parse=always_calls, max_new_tokens=8)
    client = TokenClient(engine, sampling={"temperature": 1.0})
    (traj,) = loop.run_group(client, {"messages": MESSAGES}, 1, group_id=0, seed=2)
    assert traj.finish_reason == "max_tokens" and len(traj.response_ids) <= 40
    assert traj.num_turns < 8


def _turn_outputs(traj):
    """Runs of mask-1 tokens: what the model generated in each turn."""
    runs, cur = [], []
    for t, m in zip(traj.response_ids, traj.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def _find_all(seq, sub):
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i: i + len(sub)] == sub]


def test_the_loop_takes_any_shared_parser_by_name():
    """ToolLoop reads turns with hotswap.engine.parsers; a name picks the format."""
    mistral = ToolLoop({}, parse="mistral").parse
    assert mistral('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abcDEF123"}]') == [
        ("f", {"a": 1})]
    llama3 = ToolLoop({}, parse="llama3").parse
    assert llama3('<|python_tag|>{"name": "g", "parameters": {"s": "}"}}') == [("g", {"s": "}"})]
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolLoop({}, parse="nope")


def test_a_forced_call_grammar_makes_every_turn_a_real_call(engine):
    """The server's grammar as a sampling parameter: the random model's turns become calls that
    the shared parser reads, and the tools run on their arguments."""
    from hotswap.engine.parsers import tool_parser
    from hotswap.engine.parsers.grammar import forced_calls_ebnf

    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 99},
                                               "b": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["a", "b"]}
    tools = [{"type": "function", "function": {"name": "mul", "parameters": schema}}]
    seen = []

    def mul(a: int, b: int) -> int:
        seen.append((a, b))
        return a * b

    loop = ToolLoop({"mul": mul}, max_turns=2, max_new_tokens=64,
                    ebnf=forced_calls_ebnf(tool_parser("hermes"), tools, parallel=False))
    trajs = loop.run_group(TokenClient(engine, sampling={"temperature": 1.0}),
                           {"messages": MESSAGES}, 4, group_id=0, seed=3)
    for traj in trajs:
        assert traj.finish_reason == "max_turns" and traj.parse_errors == 0
        assert traj.tool_calls == 1  # the first turn's call ran; the second turn hit max_turns
    assert len(seen) == 4 and all(0 <= a <= 99 and 0 <= b <= 99 for a, b in seen)


def test_sessions_keep_each_trajectory_pinned_between_turns(engine):
    """With sessions=True every trajectory holds a session while its tools run: each later
    turn finds all of its previous turns in the cache, and the sessions close at the end."""
    loop = ToolLoop({"mul": lambda a, b: a * b}, max_turns=3, parse=always_calls,
                    max_new_tokens=6, sessions=True)
    client = TokenClient(engine, sampling={"temperature": 1.0})
    trajs = loop.run_group(client, {"messages": MESSAGES}, 3, group_id=0, seed=2)
    assert len({tuple(t.response_ids) for t in trajs}) == 3  # each its own seed
    assert all(t.num_turns == 3 for t in trajs)
    assert engine.get_load()["sessions"] == 0
    engine.check_integrity()
