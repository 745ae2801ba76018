"""SamplingBatchInfo: one step's sampling arguments as flat tensors, and the logit edits.

`process_logits` applies every per-row edit that comes before the draw, in this order:
  repetition penalty (HF/CTRL, over prompt + output tokens)
  -> frequency / presence penalty (OpenAI, over output tokens) and logit_bias, one sparse add
  -> min_new_tokens ban (eos + stop_token_ids) -> grammar mask -> temperature.
The sampler (sampling.py) then truncates (top_k / top_p / min_p) and draws.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch

from hotswap.engine.core.sampling_params import SamplingParams, seeded_uniform


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
        never: tuple[int, ...] = (),
    ) -> SamplingBatchInfo:
        """`seeds_step[i]`: tokens row i has generated so far; `eos_ids`: the model's eos ids;
        `never`: tokens no row samples (a vision-language model's vision tokens), banned as
        min_new_tokens bans. Token ids outside [0, vocab_size) are ignored here; `check_vocab`
        rejects them earlier."""
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
        edits = _sparse_edits(params, output_ids, prompt_ids, eos_ids, vocab, device, never)
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
    never: tuple[int, ...] = (),
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
    banned += [i * vocab + t for i in range(len(params)) for t in never if t < vocab]
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


def process_logits(
    logits: torch.Tensor, info: SamplingBatchInfo, stats: dict[str, float] | None = None
) -> torch.Tensor:
    """Penalties, logit_bias, min_new_tokens ban, grammar mask and temperature, in that order.
    Never writes into `logits` (raw logprobs need them); copies only when some step applies.
    `stats["mask_s"]` (when given) accumulates the time spent applying grammar bitmasks."""
    x = logits.float()
    owned = x is not logits
    grammar = info.grammar_rows is not None
    edits = (info.rep_index, info.add_index, info.ban_index, info.grammar_rows)
    if any(e is not None for e in edits):
        x = x if owned else x.clone()
        owned = True
        flat = x.view(-1)
        if info.rep_index is not None:
            v = flat[info.rep_index]
            flat[info.rep_index] = torch.where(v > 0, v / info.rep_penalty, v * info.rep_penalty)
        if info.add_index is not None:
            flat.index_add_(0, info.add_index, info.add_value)
        if grammar:
            start = time.perf_counter()
            apply_token_bitmask(x, info.grammar_rows, info.grammar_bitmask)
            if stats is not None:
                stats["mask_s"] = stats.get("mask_s", 0.0) + time.perf_counter() - start
        if info.ban_index is not None:
            _ban(x, info.ban_index, grammar_masked=grammar)
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
