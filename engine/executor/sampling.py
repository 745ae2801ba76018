"""Sampling: the vectorised sampler that draws each row's next token (params:
sampling_params.py; the step's arguments and the logit edits before the draw:
sampling_batch_info.py).

After `process_logits` (penalties, logit_bias, min_new_tokens ban, grammar mask, temperature),
per row: top_k -> top_p (over the top_k-renormalised distribution) -> min_p (relative to the
top token). "Processed" logprobs are those of the final, renormalised distribution the token is
drawn from.

How a token is drawn (the same arithmetic alone or in any batch, so seeds reproduce):
each sampled row gets one uniform u in [0, 1): a splitmix64 hash of (seed, step) for seeded
rows, a draw from the engine's generator otherwise. The token is the inverse CDF of the row's
distribution at u, taken in a fixed order: vocabulary order for rows without truncation,
descending-logit order (the `topk` slice) for truncated rows. Rows sampled over the whole
vocabulary use a two-level CDF: float32 masses of 128-token blocks pick a block (cumulated in
float64), then a float64 cumsum inside that block picks the token, so even tokens with
probability near 1e-8 keep their share. One uniform per row replaces the per-token noise of the
Gumbel-max trick, which on CPU costs more than the whole rest of the sampler (torch's
`exponential_` over [64, 49152] takes about 45 ms here). No reduction below runs across rows,
so a row's result depends only on its own logits, params and (seed, step); which rows share
the batch only changes how many rows each kernel processes. On CPU, where the fused kernels are
built, whole-vocabulary rows take this draw in one call (cpu_kernels.sample_rows: three passes
over each row instead of ~15 ops over [B, V]; the same blocks and float64 sums).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hotswap.engine.executor.sampling_batch_info import RowGroup, SamplingBatchInfo, process_logits
from hotswap.engine.layers import cpu_kernels

BLOCK = 128  # vocabulary block of the two-level CDF; divides every common vocabulary size
MIN_CANDIDATES = 64  # first topk width tried for truncated rows (a multiple of 16, see _round16)


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, logprob of the chosen token
    top_logprob_ids: torch.Tensor | None  # [B, k] int64, best first
    top_logprob_values: torch.Tensor | None  # [B, k] float32; -inf past a truncated support


class _GroupResult(NamedTuple):
    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_values: torch.Tensor | None


def _blocks(x: torch.Tensor, fill: float) -> torch.Tensor:
    """[n, V] -> [n, nb, BLOCK], padding the last block with `fill` (a copy only when needed)."""
    pad = (-x.shape[1]) % BLOCK
    if pad:
        x = F.pad(x, (0, pad), value=fill)
    return x.view(x.shape[0], -1, BLOCK)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """First index of each row's max: the best block by its max, then the best in that block
    (torch's argmax over the whole row is not vectorised on CPU and costs 10x more)."""
    blocks = _blocks(x, -math.inf)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)
    rows = torch.arange(x.shape[0], device=x.device)
    return best_block * BLOCK + blocks[rows, best_block].argmax(dim=-1)


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted top-k values and ids. For small k only the k blocks with the largest maxima can
    hold the top k, so the full topk runs over k * BLOCK candidates instead of the vocabulary."""
    if k * BLOCK * 4 > x.shape[1]:
        return x.topk(k, dim=-1)
    blocks = _blocks(x, -math.inf)
    best_blocks = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [n, k]
    cand = blocks.gather(1, best_blocks.unsqueeze(2).expand(-1, -1, BLOCK)).flatten(1)
    values, pos = cand.topk(k, dim=-1)
    ids = best_blocks.gather(1, pos // BLOCK) * BLOCK + pos % BLOCK
    return values, ids


def _lse(x: torch.Tensor, probs: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """[n] float64 log-sum-exp from softmax's own normaliser: p(argmax) = exp(max - lse)."""
    at = argmax.unsqueeze(1)
    return (x.gather(1, at).double() - probs.gather(1, at).double().log()).squeeze(1)


def _below(bound: torch.Tensor) -> torch.Tensor:
    # A target strictly below the top of the CDF always lands on a token with positive mass.
    return torch.nextafter(bound, torch.zeros_like(bound))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids at uniforms u [n] float64: a block by its mass, then a token inside it. Every
    sum is within a block or along one row, so a row's draw never depends on other rows."""
    blocks = _blocks(probs, 0.0)
    block_mass = blocks.sum(dim=-1)  # [n, nb] float32
    cum = block_mass.double().cumsum(dim=-1)
    total = cum[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * total, _below(total))
    # The clamps only matter for rows with no finite logit (NaN mass): a token, not a crash.
    block = torch.searchsorted(cum, target, right=True).clamp(max=cum.shape[1] - 1)  # [n, 1]
    prev = torch.where(block > 0, cum.gather(1, (block - 1).clamp(min=0)), 0.0)
    frac = (target - prev) / block_mass.gather(1, block).double()
    rows = torch.arange(u.shape[0], device=u.device)
    inner = blocks[rows, block.squeeze(1)].double().cumsum(dim=-1)
    inner_target = torch.minimum(frac * inner[:, -1:], _below(inner[:, -1:]))
    pos = torch.searchsorted(inner, inner_target, right=True).clamp(max=BLOCK - 1)
    return (block * BLOCK + pos).squeeze(1)


def _logprobs(
    x: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor, top_k: int
) -> _GroupResult:
    chosen = x.gather(1, tokens.unsqueeze(1)).squeeze(1)
    logprobs = (chosen.double() - lse).float()
    if not top_k:
        return _GroupResult(tokens, logprobs, None, None)
    values, ids = _topk(x, top_k)
    return _GroupResult(tokens, logprobs, ids, (values.double() - lse.unsqueeze(1)).float())


def _whole_vocab(
    x: torch.Tensor, u: torch.Tensor | None, return_logprob: bool, top_k: int
) -> _GroupResult:
    """Greedy rows (u is None: argmax) or rows sampled over the whole vocabulary."""
    greedy = u is None
    if greedy and not return_logprob:
        return _GroupResult(_argmax(x), None, None, None)
    if _fused(x):
        tokens, lse = cpu_kernels.sample_rows(x, u)
    else:
        probs = torch.softmax(x, dim=-1)
        argmax = _argmax(x) if greedy or return_logprob else None
        tokens = argmax if greedy else _inverse_cdf(probs, u)
        lse = _lse(x, probs, argmax) if return_logprob else None
    if not return_logprob:
        return _GroupResult(tokens, None, None, None)
    return _logprobs(x, lse, tokens, top_k)


def _fused(x: torch.Tensor) -> bool:
    """The same draw in one CPU kernel call (cpu_kernels.sample_rows) where it is built."""
    return x.dtype == torch.float32 and cpu_kernels.applies(x)


def _round16(k: int, vocab: int) -> int:
    # Slice widths that are multiples of 16 keep every element on the same vectorised code
    # path whatever the batch, so the per-row arithmetic does not change with batch-mates.
    return min(vocab, -(-k // 16) * 16)


class _Limits(NamedTuple):
    """Truncation settings and draws of some truncated rows."""

    top_k: torch.Tensor  # [n] int64, vocab_size where off
    top_p: torch.Tensor  # [n] float64
    min_p: torch.Tensor  # [n] float64
    full_mass: torch.Tensor | None  # [n] float64 sum of exp(x - max) over the whole vocabulary
    u: torch.Tensor  # [n] float64

    def take(self, rows: torch.Tensor) -> _Limits:
        return _Limits(*(None if t is None else t.index_select(0, rows) for t in self))


def _truncated(
    x: torch.Tensor, info: SamplingBatchInfo, group: RowGroup, u: torch.Tensor,
    return_logprob: bool, top_k: int,
) -> _GroupResult:
    """Rows with top_k / top_p / min_p: the inverse CDF over the kept prefix of a topk slice."""
    full_mass = None
    if info.truncated_need_full_mass:  # sum of exp(x - max) = 1 / p(argmax)
        probs = torch.softmax(x, dim=-1)
        full_mass = probs.gather(1, _argmax(x).unsqueeze(1)).squeeze(1).double().reciprocal()
    limits = _Limits(group.take(info.top_ks), group.take(info.top_ps), group.take(info.min_ps),
                     full_mass, u)
    width = _round16(max(MIN_CANDIDATES, info.max_top_k, top_k), x.shape[1])
    return _sample_slice(x, limits, width, return_logprob, top_k)


def _sample_slice(
    x: torch.Tensor, lim: _Limits, width: int, return_logprob: bool, top_k: int
) -> _GroupResult:
    """Sample from the topk slice of `width`; rows whose kept set may reach past it go again,
    alone, with a slice 8x wider (or the whole sorted vocabulary). The kept set and the draw
    are the same at any width that holds the set, so batch-mates, which set the starting
    width, change nothing."""
    vocab = x.shape[1]
    values, ids = _topk(x, width)
    weights = torch.exp(values - values[:, :1]).double()
    cum = weights.cumsum(dim=-1)
    keep = _kept(values, cum, weights, lim, vocab)
    result = _draw_from_slice(values, ids, cum, keep, lim.u, return_logprob, top_k)
    if width == vocab:
        return result
    spill = (keep >= width) & (lim.top_k >= vocab)
    if bool(spill.any()):
        rows = spill.nonzero().squeeze(1)
        wider = _round16(width * 8, vocab) if width * 32 < vocab else vocab
        redo = _sample_slice(x[rows], lim.take(rows), wider, return_logprob, top_k)
        for dst, src in zip(result, redo, strict=True):
            if dst is not None:
                dst.index_copy_(0, rows, src)
    return result


def _kept(
    values: torch.Tensor, cum: torch.Tensor, weights: torch.Tensor, lim: _Limits, vocab: int
) -> torch.Tensor:
    """How many of the slice's tokens survive top_k, then top_p, then min_p (each keeps a
    prefix of the descending slice, so the survivors are the shortest of the three prefixes)."""
    width = values.shape[1]
    keep_k = lim.top_k.clamp(max=width)
    # top_p is over the top_k-renormalised distribution, or the whole vocabulary without top_k.
    norm = cum.gather(1, (keep_k - 1).unsqueeze(1)).squeeze(1)
    if lim.full_mass is not None:
        norm = torch.where(lim.top_k < vocab, norm, lim.full_mass)
    before = F.pad(cum[:, :-1], (1, 0))  # mass strictly before each position
    keep_p = (before < (lim.top_p * norm).unsqueeze(1)).sum(dim=-1)
    keep_p = torch.where(lim.top_p < 1.0, keep_p, width)
    floor = values[:, :1].double() + lim.min_p.log().unsqueeze(1)
    keep_min_p = (values >= floor).sum(dim=-1)
    positive = (weights > 0).sum(dim=-1)
    keep = torch.minimum(torch.minimum(keep_k, keep_p), torch.minimum(keep_min_p, positive))
    return keep.clamp(min=1)


def _draw_from_slice(
    values: torch.Tensor, ids: torch.Tensor, cum: torch.Tensor, keep: torch.Tensor,
    u: torch.Tensor, return_logprob: bool, top_k: int,
) -> _GroupResult:
    kept_mass = cum.gather(1, (keep - 1).unsqueeze(1))  # [n, 1]
    target = torch.minimum(u.unsqueeze(1) * kept_mass, _below(kept_mass))
    pos = torch.searchsorted(cum, target, right=True).clamp(max=cum.shape[1] - 1)
    tokens = ids.gather(1, pos).squeeze(1)
    if not return_logprob:
        return _GroupResult(tokens, None, None, None)
    lse = values[:, :1].double() + kept_mass.log()
    logprobs = (values.gather(1, pos).double() - lse).squeeze(1).float()
    if not top_k:
        return _GroupResult(tokens, logprobs, None, None)
    top_values = (values[:, :top_k].double() - lse).float()
    past_support = torch.arange(top_k, device=values.device).unsqueeze(0) >= keep.unsqueeze(1)
    top_values = top_values.masked_fill(past_support, -math.inf)
    return _GroupResult(tokens, logprobs, ids[:, :top_k].contiguous(), top_values)


def _raw(logits: torch.Tensor, group: RowGroup, tokens: torch.Tensor, top_k: int) -> _GroupResult:
    """Logprobs of the unprocessed logits at the chosen tokens, for logprob_mode="raw" rows."""
    x = group.take(logits.float())
    lse = (cpu_kernels.sample_rows(x, None)[1] if _fused(x)
           else _lse(x, torch.softmax(x, dim=-1), _argmax(x)))
    return _logprobs(x, lse, group.take(tokens), top_k)


def _put(dst: torch.Tensor | None, group: RowGroup, src: torch.Tensor | None) -> None:
    if dst is None or src is None:
        return
    if group.is_all:
        dst.copy_(src)
    else:
        dst.index_copy_(0, group.rows, src)


class Sampler:
    """Draws the next token of every row; see the module docstring for the method."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = {"mask_s": 0.0}

    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        generator: torch.Generator | None = None,
        checks: SampledChecks | None = None,
    ) -> SampleOutput:
        """`logits` [B, V] (not modified); `top_logprobs_num` is the max over rows (trim per
        row); `generator` draws for rows without a seed and must live on the logits' device;
        `checks`: rows (of the full group) that verify a sampled draft instead of drawing
        (engine/speculative/verify.py)."""
        x = process_logits(logits, info, self.stats)
        u = _uniforms(info, generator)
        bsz, vocab = x.shape
        k = min(top_logprobs_num, vocab) if return_logprob else 0
        out = SampleOutput(
            torch.empty(bsz, dtype=torch.int64, device=x.device),
            torch.empty(bsz, dtype=torch.float32, device=x.device) if return_logprob else None,
            torch.empty(bsz, k, dtype=torch.int64, device=x.device) if k else None,
            torch.empty(bsz, k, dtype=torch.float32, device=x.device) if k else None,
        )
        results = []
        if info.greedy is not None:
            results.append((info.greedy,
                            _whole_vocab(info.greedy.take(x), None, return_logprob, k)))
        if info.full is not None:
            g = info.full
            results.append((g, _whole_vocab(g.take(x), g.take(u), return_logprob, k)))
        if info.truncated is not None:
            g = info.truncated
            results.append((g, _truncated(g.take(x), info, g, g.take(u), return_logprob, k)))
        for group, result in results:
            for dst, src in zip(out, result, strict=True):
                _put(dst, group, src)
        if checks is not None:
            rows = checks.rows.to(x.device)
            checked = x.index_select(0, rows)
            tokens = check_sampled(checked, checks, generator)
            out.next_token_ids.index_copy_(0, rows, tokens)
            if return_logprob:
                lse = torch.logsumexp(checked.double(), dim=-1)
                chosen = checked.gather(1, tokens[:, None]).squeeze(1).double()
                out.logprobs.index_copy_(0, rows, (chosen - lse).float())
        if return_logprob and info.raw is not None:
            raw = _raw(logits, info.raw, out.next_token_ids, k)
            for dst, src in zip(out[1:], raw[1:], strict=True):
                _put(dst, info.raw, src)
        return out


def _uniforms(info: SamplingBatchInfo, generator: torch.Generator | None) -> torch.Tensor:
    if info.unseeded is None:
        return info.uniforms
    rows = info.unseeded.rows
    draws = torch.rand(rows.shape[0], dtype=torch.float64, device=rows.device,
                       generator=generator)
    return info.uniforms.index_copy(0, rows, draws)


class SampledChecks(NamedTuple):
    """The sampling rows of a step that check a sampled draft, and those drafts."""

    rows: torch.Tensor  # [n] int64: sampling rows (logits rows) holding a sampled draft
    tokens: torch.Tensor  # [n] int64: the drafted token at each
    q: torch.Tensor  # [n, Vd] float32: the draft's distribution there, over the token map
    index: torch.Tensor  # [n] int64: each drafted token's index in the token map
    token_map: torch.Tensor  # [Vd] int64


def check_sampled(x: torch.Tensor, checks: SampledChecks,
                  generator: torch.Generator | None) -> torch.Tensor:
    """The token each checked row emits, from its processed logits x [n, V]: its draft where
    the min(1, p / q) rule keeps it, else a draw from the residual. A rejection implies
    p(x_j) < q(x_j), so the residual is zero at the draft itself (set exactly, not rounded)."""
    p = torch.softmax(x.float(), dim=-1)
    q = checks.q.to(p.device, torch.float32)
    tokens = checks.tokens.to(p.device)
    px = p.gather(1, tokens[:, None]).squeeze(1)
    qx = q.gather(1, checks.index.to(p.device)[:, None]).squeeze(1)
    u = torch.rand(len(tokens), dtype=torch.float64, device=p.device, generator=generator)
    keep = u * qx.double() < px.double()
    residual = p.clone()
    token_map = checks.token_map.to(p.device)
    residual[:, token_map] -= q
    residual.clamp_(min=0).scatter_(1, tokens[:, None], 0.0)
    # rows where p <= q up to rounding never reject; their residual may sum to 0: any stand-in
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    return torch.where(keep, tokens, draw(residual, generator))


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of `weights` [n, V] (non-negative, any total), drawn in proportion:
    the two-level inverse CDF at a uniform from `generator` (torch.multinomial costs ~1 ms a
    row at V = 49,152 on CPU)."""
    u = torch.rand(weights.shape[0], dtype=torch.float64, device=weights.device,
                   generator=generator)
    return _inverse_cdf(weights, u)
