"""SmolLM2-135M-Instruct (the converted real checkpoint) against HF transformers."""

from __future__ import annotations

import pytest
import torch
import transformers

from hotswap.engine import Engine

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "What is 12 times 7?",
    "Name a famous painter.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def hf_model(real_model_path):
    return transformers.AutoModelForCausalLM.from_pretrained(real_model_path,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(real_model_path):
    with Engine(real_model_path, dtype="float32", max_total_tokens=16384) as eng:
        yield eng


def chat_ids(engine: Engine, question: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_greedy_tokens_match_hf_generate(engine, hf_model):
    prompts = [chat_ids(engine, q) for q in QUESTIONS]
    outs = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": 32, "temperature": 0, "ignore_eos": True})
    matches = []
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        matches.append(sum(a == b for a, b in zip(out["output_ids"], ref)))
        assert out["output_ids"] == ref
    assert matches == [32] * len(QUESTIONS)


def test_teacher_forced_logprobs_match_hf(engine, hf_model):
    """Sample 64 tokens, then compare each token's raw logprob with HF's forward over the
    same sequence."""
    ids = chat_ids(engine, QUESTIONS[2])
    out = engine.generate(input_ids=ids, return_logprob=True, sampling_params={
        "max_new_tokens": 64, "temperature": 1.0, "seed": 3, "ignore_eos": True,
        "logprob_mode": "raw"})
    gen = out["output_ids"]
    assert len(gen) == 64
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + gen])).logits[0, len(ids) - 1: -1].float()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(gen)[:, None])[:, 0]
    ours = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
    assert (ours - ref).abs().max().item() < 1e-3
