"""Programs: fork reuse of prefix KV, one n=k request for a fork's gen, select vs HF scores."""

from __future__ import annotations

import pytest
import torch
import transformers

from hotswap.engine import Engine
from hotswap.rollout import TokenClient, assistant, function, gen, select, system, user
from hotswap.rollout.program import ProgramState


@pytest.fixture(scope="module")
def engine(tiny_chat_model_path):
    with Engine(tiny_chat_model_path, device="cpu", dtype="float32",
                max_total_tokens=8192) as eng:
        yield eng


@function
def ask_then_branch(s, question):
    s += system("Be brief.") + user(question) + assistant(gen("answer", max_new_tokens=4))
    branches = s.fork(3)
    branches += user("Are you sure?") + assistant(gen("check", max_new_tokens=4))
    s.variables["branches"] = branches


def test_fork_shares_prefix_kv_and_generates_as_one_request(engine):
    client = TokenClient(engine, sampling={"temperature": 1.0})
    (state,) = ask_then_branch.run_batch([{"question": "What is 2 + 2?"}], client=client)
    assert client.stats["requests"] == 2  # the fork's gen was one n=3 request
    branches = state.variables["branches"]
    prefix = len(state.ids)
    tok = engine.tokenizer
    for b in branches:
        assert b.ids[:prefix] == state.ids
        # the fork read the prefix's KV from the cache (all but its last few, never-fed tokens)
        assert b.cached_tokens - state.cached_tokens >= state.first_gen > 0
        assert b["answer"] == state["answer"] and isinstance(b["check"], str)
        # token state == the template rendering of the conversation it built
        assert tok.decode(b.ids, skip_special_tokens=False) == tok.apply_chat_template(
            b.messages, tokenize=False)
        assert [m["role"] for m in b.messages] == ["system", "user", "assistant", "user",
                                                   "assistant"]
        traj = b.to_trajectory()
        assert sum(traj.loss_mask) == len([v for v in traj.versions if v is not None])
        assert sum(traj.loss_mask) >= 2  # both gens' tokens are trainable
    # different branches after the fork: one batched call, every prompt reuses the prefix
    before = client.stats["requests"]
    forks = state.fork(2)
    for i, f in enumerate(forks):
        f += user(f"Variant {i}")
    forks += assistant(gen("v", max_new_tokens=3))
    assert client.stats["requests"] == before + 2
    assert all(f.cached_tokens - state.cached_tokens >= state.first_gen for f in forks)


def test_select_scores_match_hf_teacher_forcing(engine, tiny_chat_model_path):
    client = TokenClient(engine)
    state = ProgramState(client)
    state += user("Pick a colour.")
    prefix = state.ids + state.deltas.generation_prompt()
    choices = ["red", "green", "a blue sky"]
    state += assistant(select("colour", choices))
    scores = state["colour_scores"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_model_path,
                                                           dtype=torch.float32).eval()
    expected = []
    for choice in choices:
        ids = engine.tokenizer.encode(choice, add_special_tokens=False)
        with torch.no_grad():
            logits = hf(torch.tensor([prefix + ids])).logits[0].float()
        logp = torch.log_softmax(logits[len(prefix) - 1: -1], -1)
        expected.append(logp.gather(1, torch.tensor(ids)[:, None]).sum().item())
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=1e-4, rtol=0)
    best = max(range(3), key=expected.__getitem__)
    assert state["colour"] == choices[best]  # greedy: the highest total logprob
    picked = engine.tokenizer.encode(choices[best], add_special_tokens=False)
    assert state.ids[len(prefix): len(prefix) + len(picked)] == picked
    assert state.mask[len(prefix):] == [0] * (len(state.ids) - len(prefix))  # not sampled
