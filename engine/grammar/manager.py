"""GrammarManager: the grammar resource of one engine.

It validates grammars at submit, compiles them on a worker thread behind a cache keyed by
(kind, text, tokenizer), gives every sample its own matcher, and builds each step's bitmask,
on a second worker while the step's forward runs when the step's rows are known in advance.
The scheduler calls it; it never touches scheduling state.

Invariant: a sample's matcher has accepted exactly its output tokens (RequestGrammar.sync
rolls it back when fewer are kept), so a recomputed (retracted) request resumes its grammar
where its tokens left it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from hotswap.engine.core.request import FinishReason, Req
from hotswap.engine.core.sampling_params import SamplingParams
from hotswap.engine.grammar import GRAMMAR_BACKENDS, get_grammar_backend
from hotswap.engine.grammar.base import GrammarBackend, TokenMatcher, bitmask_words

CACHE_ENTRIES = 512  # compiled grammars kept (RL jobs reuse a handful of schemas)


class RequestGrammar:
    """One sample's grammar: the compile job it shares with its siblings, then its own matcher."""

    def __init__(self, job: Future, backend: GrammarBackend):
        self.job = job
        self._backend = backend
        self._matcher: TokenMatcher | None = None
        self.accepted = 0  # tokens the matcher has taken

    @property
    def ready(self) -> bool:
        return self.job.done()

    def error(self) -> str | None:
        exc = self.job.exception() if self.job.done() else None
        return None if exc is None else f"grammar failed to compile: {exc}"

    @property
    def matcher(self) -> TokenMatcher:
        if self._matcher is None:
            self._matcher = self._backend.matcher(self.job.result())
        return self._matcher

    def accept(self, token: int) -> bool:
        ok = self.matcher.accept_token(token)
        self.accepted += ok
        return ok

    def replay(self, tokens: list[int]) -> None:
        """Feed the tokens past those taken (sampled elsewhere under the same grammar)."""
        for token in tokens[self.accepted:]:
            if not self.accept(token):
                break

    def sync(self, kept_tokens: int) -> None:
        """Roll the matcher back to the first `kept_tokens` output tokens."""
        if self.accepted > kept_tokens:
            self.matcher.rollback(self.accepted - kept_tokens)
            self.accepted = kept_tokens


class StepMasks(NamedTuple):
    rows: torch.Tensor  # [n] int64: the constrained rows of the step's sampling batch
    mask: torch.Tensor  # [n, V] float32 additive bias (CPU) or [n, ceil(V / 32)] int32 bits


def additive_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed bits -> float32 [n, V]: 0.0 where allowed, -inf where not. Done with numpy (no
    torch op: a second thread running torch ops slows the scheduler's OpenMP team, see
    engine.py), by writing the float bit patterns directly: 0x00000000 and 0xFF800000."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    neg_inf_bits = np.int32(-8388608)  # 0xFF800000
    bias = ((bits[:, :vocab_size].astype(np.int32) - 1) & neg_inf_bits).view(np.float32)
    return torch.from_numpy(bias)


class _Prefetch(NamedTuple):
    reqs: list[Req]  # the step's sampling requests, in row order
    future: Future  # -> the masks of their constrained rows, made on the mask worker


class GrammarManager:
    def __init__(self, backend_name: str, tokenizer: Any, vocab_size: int,
                 stop_token_ids: Sequence[int], device: torch.device):
        if backend_name not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {sorted(GRAMMAR_BACKENDS)}, "
                             f"got {backend_name!r}")
        self.vocab_size = vocab_size
        self.device = device
        self._backend_args = (backend_name, tokenizer, vocab_size, list(stop_token_ids))
        self._backend: GrammarBackend | None = None
        self._tokenizer_key = (getattr(tokenizer, "name_or_path", ""), vocab_size)
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="hotswap-grammar-compile")
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="hotswap-grammar-mask")
        # Seconds the scheduler thread spent on grammar work (waiting for a mask, filling
        # masks it could not prefetch, accepting tokens); "fill_s" is the workers' fill time.
        self.stats = {"critical_s": 0.0, "fill_s": 0.0, "compiles": 0, "cache_hits": 0}

    @property
    def backend(self) -> GrammarBackend:
        # Imported on the first grammar request: engines that never see one never load it.
        with self._lock:
            if self._backend is None:
                self._backend = get_grammar_backend(*self._backend_args)
            return self._backend

    def shutdown(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self._masker.shutdown(wait=False, cancel_futures=True)

    # --- submit (caller's thread) ---

    def request_grammar(self, params: SamplingParams) -> Future | None:
        """Validate the request's grammar (ValueError naming the problem) and start compiling it;
        the returned job is shared by every sample (`for_sample` gives each its matcher)."""
        spec = params.grammar
        if spec is None:
            return None
        key = (*spec, self._tokenizer_key)
        backend = self.backend
        with self._lock:
            job = self._cache.get(key)
            if job is not None and not (job.done() and job.exception() is not None):
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                return job
        parsed = backend.parse(spec)  # raises outside the lock
        with self._lock:
            job = self._compiler.submit(self._compile, parsed)
            self._cache[key] = job
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return job

    def _compile(self, parsed: Any) -> Any:
        self.stats["compiles"] += 1
        return self.backend.compile(parsed)

    def for_sample(self, job: Future | None) -> RequestGrammar | None:
        return None if job is None else RequestGrammar(job, self.backend)

    # --- per step (scheduler thread) ---

    def prefetch(self, reqs: list[Req]) -> _Prefetch | None:
        """Start filling the masks of `reqs` (the rows that will sample this step) on the mask
        worker; the matchers do not change until the step's tokens are accepted."""
        rows = [r for r in reqs if r.grammar is not None]
        if not rows:
            return None
        matchers = [r.grammar.matcher for r in rows]  # created here, never on the worker
        bitmask = torch.empty(len(rows), bitmask_words(self.vocab_size), dtype=torch.int32)
        return _Prefetch(reqs, self._masker.submit(self._fill, matchers, bitmask))

    def _fill(self, matchers: list[TokenMatcher], bitmask: torch.Tensor) -> torch.Tensor:
        """Fill the packed masks; on CPU also expand them to the sampler's additive bias."""
        start = time.perf_counter()
        self.backend.fill_bitmask(matchers, bitmask)
        mask = bitmask if self.device.type != "cpu" else additive_bias(bitmask, self.vocab_size)
        self.stats["fill_s"] += time.perf_counter() - start
        return mask

    def step_masks(self, reqs: list[Req], prefetched: _Prefetch | None,
                   device: torch.device) -> StepMasks | None:
        """The bitmask rows of the constrained `reqs` (the sampling batch, in order). Rows the
        prefetch covered come from it; the rest (forks started this step) are filled now."""
        start = time.perf_counter()
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        parts = []
        if prefetched is not None and _same_prefix(reqs, prefetched.reqs):
            parts.append(prefetched.future.result())  # the first constrained rows, in order
        done = parts[0].shape[0] if parts else 0
        rest = [reqs[i].grammar.matcher for i in rows[done:]]
        if rest:
            words = bitmask_words(self.vocab_size)
            parts.append(self._fill(rest, torch.empty(len(rest), words, dtype=torch.int32)))
        mask = parts[0] if len(parts) == 1 else torch.cat(parts)
        self.stats["critical_s"] += time.perf_counter() - start
        return StepMasks(torch.tensor(rows, dtype=torch.int64, device=device),
                         mask.to(device, non_blocking=True))

    def accept(self, req: Req) -> FinishReason | None:
        """Feed `req`'s newest token to its matcher: `stop` when the grammar has terminated,
        `abort` if the token was not allowed (only when no allowed token had finite logit)."""
        start = time.perf_counter()
        token = req.output_ids[-1]
        ok = req.grammar.accept(token)
        terminated = req.grammar.matcher.is_terminated()
        self.stats["critical_s"] += time.perf_counter() - start
        if not ok:
            return FinishReason.aborted("grammar", f"token {token} is not allowed by the grammar")
        return FinishReason("stop", matched=token) if terminated else None


def _same_prefix(reqs: list[Req], prefix: list[Req]) -> bool:
    return len(reqs) >= len(prefix) and all(a is b for a, b in zip(reqs, prefix))
