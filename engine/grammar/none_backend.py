"""The "none" grammar backend: every grammar request is refused at submit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hotswap.engine.grammar.base import GrammarBackend, GrammarSpec, TokenMatcher


class NoGrammarBackend(GrammarBackend):
    name = "none"

    def parse(self, spec: GrammarSpec) -> Any:
        raise ValueError(f"sampling_params.{spec[0]}: grammar-constrained decoding is off in "
                         "this engine (grammar_backend='none')")

    def compile(self, parsed: Any) -> Any:
        raise AssertionError("parse() refuses every grammar")

    def matcher(self, compiled: Any) -> TokenMatcher:
        raise AssertionError("parse() refuses every grammar")

    def fill_bitmask(self, matchers: Sequence[TokenMatcher], bitmask: torch.Tensor) -> None:
        raise AssertionError("parse() refuses every grammar")
