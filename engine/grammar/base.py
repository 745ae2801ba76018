"""The grammar backend interface: parse a grammar spec, compile it, match tokens against it.

A backend is chosen by name from the registry in __init__.py. Parsing is cheap and runs at
submit so a bad grammar fails there with a ValueError; compiling (building the token-mask tables
for the model's vocabulary) is the expensive part and runs on the manager's worker thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import torch

GrammarSpec = tuple[str, "str | tuple[str, ...]"]  # (kind, text): SamplingParams.grammar


class TokenMatcher(Protocol):
    """One sample's position in its grammar."""

    def accept_token(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool: ...


class GrammarBackend(ABC):
    name: str

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)

    @abstractmethod
    def parse(self, spec: GrammarSpec) -> Any:
        """Check the grammar (cheap, no vocabulary work); ValueError naming the problem."""

    @abstractmethod
    def compile(self, parsed: Any) -> Any:
        """The compiled grammar that matchers start from (expensive: run off the scheduler)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> TokenMatcher:
        """A fresh matcher at the grammar's start."""

    @abstractmethod
    def fill_bitmask(self, matchers: Sequence[TokenMatcher], bitmask: torch.Tensor) -> None:
        """Write each matcher's allowed next tokens into bitmask[i] (int32, 32 tokens a word,
        bit j of word w = token 32 * w + j; 1 = allowed)."""


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)
