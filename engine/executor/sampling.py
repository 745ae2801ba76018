"""Sampling: the per-step batch tensors and the vectorised sampler (params: sampling_params.py).

Logit processing order, every step, per row:
  repetition penalty (HF/CTRL, over prompt + output tokens)
  -> frequency / presence penalty (OpenAI, over output tokens) and logit_bias, one sparse add
  -> min_new_tokens ban (eos + stop_token_ids) -> grammar mask -> temperature
  -> top_k -> top_p (over the top_k-renormalised distribution) -> min_p (relative to the top token).
"Processed" logprobs are those of the final, renormalised distribution the token is drawn from.

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
import time
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hotswap.engine.core.sampling_params import SamplingParams, seeded_uniform
from hotswap.engine.layers import cpu_kernels

BLOCK = 128  # vocabulary block of the two-level CDF; divides every common vocabulary size
MIN_CANDIDATES = 64  # first topk width tried for truncated rows (a multiple of 16, see _round16)


class RowGroup(NamedTuple):
    rows: torch.Tensor  # [n] int64 batch rows, ascending
    is_all: bool  # the group is the whole batch in order: take tensors as they are

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.is_all else t.index_select(0, self.rows)


def _group(rows: list[int], batch_size: int, device: torch.device) -> RowGroup | None:
    if not rows:
        return None
    return RowGroup(torch.tensor(rows, dtype=torch.int64, device=device), len(rows) == batch_size)


@dataclass
class SamplingBatchInfo:
    """One step's sampling arguments as flat tensors, built once per step from the batch rows.

    Rows fall into three groups that are processed apart: greedy (argmax), full (sampled over
    the whole vocabulary) and truncated (top_k / top_p / min_p: sampled from a topk slice).
    Sparse edits are flat indices into the [B, V] logits (row * V + token); a None field means
    no row needs that step, and the sampler skips it.
    """

    batch_size: int
    vocab_size: int
    temperatures: torch.Tensor  # [B, 1] float32, 1.0 for greedy rows
    top_ks: torch.Tensor  # [B] int64, vocab_size where off
    top_ps: torch.Tensor  # [B] float64, 1.0 where off
    min_ps: torch.Tensor  # [B] float64, 0.0 where off
    uniforms: torch.Tensor  # [B] float64: seeded rows' draws; NaN where the generator draws
    greedy: RowGroup | None
    full: RowGroup | None
    truncated: RowGroup | None
    unseeded: RowGroup | None  # sampled rows without a seed
    raw: RowGroup | None  # rows whose logprobs are of the unprocessed logits
    need_temperature: bool
    truncated_need_full_mass: bool  # some truncated row has top_p without top_k
    max_top_k: int  # over truncated rows with top_k; 0 when none
    rep_index: torch.Tensor | None  # [N] flat indices of prompt + output tokens (repeats allowed)
    rep_penalty: torch.Tensor | None  # [N] float32
    add_index: torch.Tensor | None  # [M] flat indices: frequency/presence penalties, logit_bias
    add_value: torch.Tensor | None  # [M] float32
    ban_index: torch.Tensor | None  # [K] flat indices banned by min_new_tokens
    # Grammar rows and their packed masks (grammar/manager.py fills them; None: no grammar row)
    grammar_rows: torch.Tensor | None = None  # [G] int64 batch rows
    grammar_bitmask: torch.Tensor | None = None  # [G, V] float32 bias or [G, V/32] int32 bits

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_ids: list[list[int]],
        prompt_ids: list[list[int]],
        seeds_step: list[int],
        eos_ids: list[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingBatchInfo:
        """`seeds_step[i]`: tokens row i has generated so far; `eos_ids`: the model's eos ids.
        Token ids outside [0, vocab_size) are ignored here; `check_vocab` rejects them earlier."""
        device = torch.device(device)
        bsz, vocab = len(params), vocab_size
        temps, top_ks, top_ps, min_ps, uniforms = [], [], [], [], []
        groups: dict[str, list[int]] = {"greedy": [], "full": [], "truncated": [],
                                        "unseeded": [], "raw": []}
        for i, p in enumerate(params):
            greedy = p.is_greedy
            temps.append(1.0 if greedy else p.temperature)
            top_ks.append(vocab if greedy or p.top_k < 0 else min(p.top_k, vocab))
            top_ps.append(1.0 if greedy else p.top_p)
            min_ps.append(0.0 if greedy else p.min_p)
            truncated = top_ks[-1] < vocab or top_ps[-1] < 1.0 or min_ps[-1] > 0.0
            groups["greedy" if greedy else "truncated" if truncated else "full"].append(i)
            if p.logprob_mode == "raw":
                groups["raw"].append(i)
            if not greedy and p.seed is None:
                groups["unseeded"].append(i)
            seeded = not greedy and p.seed is not None
            uniforms.append(seeded_uniform(p.seed, seeds_step[i]) if seeded else math.nan)
        trunc = groups["truncated"]
        edits = _sparse_edits(params, output_ids, prompt_ids, eos_ids, vocab, device)
        return cls(
            batch_size=bsz,
            vocab_size=vocab,
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device).view(bsz, 1),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float64, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float64, device=device),
            uniforms=torch.tensor(uniforms, dtype=torch.float64, device=device),
            **{name: _group(rows, bsz, device) for name, rows in groups.items()},
            need_temperature=any(t != 1.0 for t in temps),
            truncated_need_full_mass=any(top_ps[i] < 1.0 and top_ks[i] == vocab for i in trunc),
            max_top_k=max((top_ks[i] for i in trunc if top_ks[i] < vocab), default=0),
            **edits,
        )


def _flat_tokens(
    rows: list[int], seqs: list[list[int]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices (row * vocab + token) of every in-vocabulary token of seqs (one per row),
    with the row of each; built by torch from one concatenated list, not token by token."""
    tokens = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.int64)
    row = torch.repeat_interleave(torch.tensor(rows), torch.tensor([len(s) for s in seqs]))
    keep = (tokens >= 0) & (tokens < vocab)
    return (row * vocab + tokens)[keep], row[keep]


def _sparse_edits(
    params: list[SamplingParams],
    output_ids: list[list[int]],
    prompt_ids: list[list[int]],
    eos_ids: list[int],
    vocab: int,
    device: torch.device,
) -> dict[str, torch.Tensor | None]:
    edits: dict[str, torch.Tensor | None] = dict.fromkeys(
        ("rep_index", "rep_penalty", "add_index", "add_value", "ban_index"))
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        # Duplicates are harmless: every copy of a token reads and writes the same value.
        index, row = _flat_tokens(rep_rows, [prompt_ids[i] + output_ids[i] for i in rep_rows],
                                  vocab)
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        edits["rep_index"], edits["rep_penalty"] = index, penalty[row]
    add_index, add_value = _additive_edits(params, output_ids, vocab)
    if add_index is not None:
        edits["add_index"], edits["add_value"] = add_index, add_value
    banned = [i * vocab + t for i, p in enumerate(params) if len(output_ids[i]) < p.min_new_tokens
              for t in set(p.stop_token_ids) | set(() if p.ignore_eos else eos_ids) if t < vocab]
    if banned:
        edits["ban_index"] = torch.tensor(banned, dtype=torch.int64)
    return {k: None if v is None else v.to(device) for k, v in edits.items()}


def _additive_edits(
    params: list[SamplingParams], output_ids: list[list[int]], vocab: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Frequency (once per occurrence), presence (once per distinct token) and logit_bias."""
    indices: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    pen_rows = [i for i, p in enumerate(params)
                if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if pen_rows:
        index, row = _flat_tokens(pen_rows, [output_ids[i] for i in pen_rows], vocab)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
        distinct = torch.unique(index)
        indices += [index, distinct]
        values += [-freq[row], -presence[distinct // vocab]]
    bias = [(i * vocab + t, b) for i, p in enumerate(params)
            for t, b in (p.logit_bias or {}).items() if t < vocab]
    if bias:
        indices.append(torch.tensor([i for i, _ in bias], dtype=torch.int64))
        values.append(torch.tensor([b for _, b in bias], dtype=torch.float32))
    if not indices:
        return None, None
    return torch.cat(indices), torch.cat(values)


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


def process_logits(
    logits: torch.Tensor, info: SamplingBatchInfo, vocab_mask: torch.Tensor | None = None,
    stats: dict[str, float] | None = None,
) -> torch.Tensor:
    """Penalties, logit_bias, min_new_tokens ban, grammar mask and temperature, in that order.
    Never writes into `logits` (raw logprobs need them); copies only when some step applies.
    `stats["mask_s"]` (when given) accumulates the time spent applying grammar bitmasks."""
    x = logits.float()
    owned = x is not logits
    grammar = info.grammar_rows is not None
    edits = (info.rep_index, info.add_index, info.ban_index, vocab_mask, info.grammar_rows)
    if any(e is not None for e in edits):
        x = x if owned else x.clone()
        owned = True
        flat = x.view(-1)
        if info.rep_index is not None:
            v = flat[info.rep_index]
            flat[info.rep_index] = torch.where(v > 0, v / info.rep_penalty, v * info.rep_penalty)
        if info.add_index is not None:
            flat.index_add_(0, info.add_index, info.add_value)
        if vocab_mask is not None:
            x.masked_fill_(~vocab_mask, -math.inf)
        if grammar:
            start = time.perf_counter()
            apply_token_bitmask(x, info.grammar_rows, info.grammar_bitmask)
            if stats is not None:
                stats["mask_s"] = stats.get("mask_s", 0.0) + time.perf_counter() - start
        if info.ban_index is not None:
            _ban(x, info.ban_index, grammar_masked=vocab_mask is not None or grammar)
    if info.need_temperature:
        x = x.div_(info.temperatures) if owned else x / info.temperatures
    return x


_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(x: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """Disallow tokens in rows `rows` of x, in place; other rows are untouched. `mask` is
    either an additive float32 bias [G, V] (0 allowed, -inf not; the CPU form, expanded off
    the critical path by grammar/manager.py) or packed int32 words [G, ceil(V / 32)] (bit t of
    a row = token t allowed; expanded here with two tensor ops, the form for GPUs)."""
    if mask.is_floating_point():
        x.index_add_(0, rows, mask)
        return
    weights = _BIT_WEIGHTS.get(x.device)
    if weights is None:
        bits = torch.arange(32, dtype=torch.int32, device=x.device)
        weights = _BIT_WEIGHTS.setdefault(x.device, torch.ones_like(bits) << bits)
    blocked = (mask.unsqueeze(-1) & weights).eq(0).view(rows.shape[0], -1)[:, : x.shape[1]]
    x.index_copy_(0, rows, x.index_select(0, rows).masked_fill_(blocked, -math.inf))


def _ban(x: torch.Tensor, ban_index: torch.Tensor, grammar_masked: bool) -> None:
    flat = x.view(-1)
    saved = flat[ban_index]
    flat.index_fill_(0, ban_index, -math.inf)
    if not grammar_masked:
        return
    # The grammar wins: where it allows only banned tokens (say, only eos), lift the ban.
    dead = torch.isneginf(x.amax(dim=-1))
    lift = dead[ban_index // x.shape[1]]
    if bool(lift.any()):
        flat[ban_index[lift]] = saved[lift]


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
        vocab_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> SampleOutput:
        """`logits` [B, V] (not modified); `vocab_mask` [B, V] bool, True = allowed;
        `top_logprobs_num` is the max over rows (trim per row); `generator` draws for rows
        without a seed and must live on the logits' device."""
        x = process_logits(logits, info, vocab_mask, self.stats)
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
