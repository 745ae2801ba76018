"""Incremental detokenization and stop strings on SmolLM2's real tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from hotswap.engine.core.request import IncrementalDetokenizer

TEXTS = [
    "plain ascii text, with punctuation!",
    "héllo wörld — naïve café",
    "emoji 🙂🚀 and CJK 世界你好 mixed",
    "numbers 1234567 and ½ ¼ fractions",
]


@pytest.fixture(scope="module")
def tokenizer(real_model_path):
    return AutoTokenizer.from_pretrained(real_model_path)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    deltas = [detok.update(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)  # never a half-decoded character
