"""Grammar-constrained decoding: backends by name (lazy imports), compile cache, per-sample state.

The scheduler holds one GrammarManager; each constrained Req carries a RequestGrammar (its
compile job, then its matcher); the step's bitmask is applied before sampling
(executor/sampling_batch_info.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from hotswap.engine.grammar.base import GrammarBackend

GRAMMAR_BACKENDS = {
    "xgrammar": "hotswap.engine.grammar.xgrammar_backend:XGrammarBackend",
    "none": "hotswap.engine.grammar.none_backend:NoGrammarBackend",
}


def get_grammar_backend(name: str, tokenizer: Any, vocab_size: int,
                        stop_token_ids: Sequence[int]) -> GrammarBackend:
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"grammar_backend must be one of {sorted(GRAMMAR_BACKENDS)}, "
                         f"got {name!r}")
    module, cls = GRAMMAR_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(tokenizer, vocab_size, stop_token_ids)
