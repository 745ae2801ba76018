"""The xgrammar backend: JSON schema, regex, EBNF and choices compiled against the model's
tokenizer; masks filled by xgrammar's batch matcher."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from hotswap.engine.grammar.base import GrammarBackend, GrammarSpec, TokenMatcher

# xgrammar's C++ errors start with "[time] /path/file.cc:123: " and sometimes an assertion text.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _NOISE.sub("", first)


def choices_ebnf(choices: Sequence[str]) -> str:
    """`choices` as a grammar: the root is exactly one of the alternatives (JSON string
    literals are valid EBNF literals: the same quote and backslash escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        # One thread: the scheduler's forward already uses every core.
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def parse(self, spec: GrammarSpec) -> xgr.Grammar:
        kind, text = spec
        try:
            if kind == "json_schema":
                json.loads(text)  # a clearer message than the converter's for broken JSON
                return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == "regex":
                return xgr.Grammar.from_regex(text)
            if kind == "ebnf":
                return xgr.Grammar.from_ebnf(text)
            if kind == "choices":
                return xgr.Grammar.from_ebnf(choices_ebnf(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"sampling_params.json_schema: not valid JSON: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"sampling_params.{kind}: invalid grammar: {_clean(exc)}") from None
        raise ValueError(f"unknown grammar kind {kind!r}")

    def compile(self, parsed: xgr.Grammar) -> xgr.CompiledGrammar:
        return self._grammar_compiler().compile_grammar(parsed)

    def _grammar_compiler(self) -> xgr.GrammarCompiler:
        # Built on first use (on the compile worker): reading the vocabulary takes ~0.2 s.
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            # xgrammar keeps its own cache too; ours holds Futures so concurrent asks share one.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def matcher(self, compiled: xgr.CompiledGrammar) -> TokenMatcher:
        return xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: Sequence[TokenMatcher], bitmask: torch.Tensor) -> None:
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask)
