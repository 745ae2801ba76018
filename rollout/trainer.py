"""The GRPO job's trainer: an HF causal LM taking clipped policy-gradient steps on RolloutBatches.

A step needs log p(response token | everything before it) with gradients, for every trainable
token. The rows of a batch that share their prompt (a GRPO group) are packed into one sequence:
the prompt once, then each response without its last token (whose output predicts nothing),
every response attending to the prompt and to its own earlier tokens (a block mask) at the
positions it has in its own sequence. So a group's prompt is computed once (its activations
receive the gradients of every response of the group, as the sum of what the per-sample rows
would give them), no position is padding beyond the longest group of a micro-batch, and the LM
head and the log-softmax (49,152 wide for SmolLM2) run only on the positions that predict a
trainable token. Attention runs over a dense mask, quadratic in the packed length, so a group
of long responses is split into several sequences (split_unit).
tests/rollout/test_rollout_grpo.py checks the gradients against the one padded row per sample
that this replaced. With exact=True (the GRPO job's --exact-logprobs) the units run through
rollout/exact_forward.py instead, whose logprobs equal a deterministic engine's bit for bit.
A vision-language checkpoint (config.json with a vision_config) is loaded as HF's
AutoModelForImageTextToText and scored one sample per forward with its images
(rollout/vision_forward.py).

With a learned draft (the GRPO job's --speculative draft), each step also trains the draft
(engine/speculative/train_draft.py's DraftTrainer) on the decoder states the policy's forward
computed anyway, detached, on the same packed units (each prompt once, its responses continuing
it) with the loss on the positions that predict a response token; `named_weights` then carries
its `draft.*` tensors, so the push that brings the new policy brings the draft trained beside
it, under one version.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple

import numpy as np
import torch

from hotswap.rollout.exact_forward import ExactForward, segment_sequences
from hotswap.rollout.importance import importance_weights
from hotswap.rollout.routing_replay import replay_routes
from hotswap.rollout.trajectory import RolloutBatch
from hotswap.rollout.vision_forward import VisionScorer, is_vision_language


class Packed(NamedTuple):
    """One micro-batch as a few packed sequences ("units", one per shared prompt)."""
    input_ids: torch.Tensor  # [units, length]
    position_ids: torch.Tensor  # [units, length]
    attention_mask: torch.Tensor  # [units, 1, length, length] additive: 0 or the dtype's min
    routes: torch.Tensor | None  # [units, length, moe_layers, top_k], -1: no recorded route
    source: torch.Tensor  # [tokens] unit * length + column of the position predicting a token
    target: torch.Tensor  # [tokens] the trainable response token it predicts
    row: torch.Tensor  # [tokens] its row in the micro-batch
    col: torch.Tensor  # [tokens] its column in the response
    segments: torch.Tensor  # [units, length] 0: the prompt, k: the k-th response, -1: padding


def prompt_units(batch: RolloutBatch) -> list[list[int]]:
    """Batch rows grouped by identical prompt (and identical prompt routes under routing replay,
    so that packing never changes what a row's prompt replays; identical images, whose
    placeholder runs are the same ids for any image of the same grid), in order of first
    appearance."""
    units: dict[tuple, list[int]] = {}
    for i, prompt in enumerate(batch.prompt_ids):
        routes = batch.routed_experts[i] if i < len(batch.routed_experts) else None
        routed = None if routes is None else np.asarray(routes[:len(prompt)]).tobytes()
        meta = batch.image_meta[i] if i < len(batch.image_meta) else []
        images = tuple(image["hash"] for image in meta)
        units.setdefault((tuple(prompt), routed, images), []).append(i)
    return list(units.values())


def split_unit(batch: RolloutBatch, unit: list[int], width: float) -> list[list[int]]:
    """A unit's rows as packed sequences of `size` responses each, the size that costs least: a
    sequence of L positions costs ~ L (the layers' matmuls) + L * L / width (attention over a
    dense mask), and a micro-batch pads every sequence to the longest. Long responses then go
    one or two a sequence, short ones all in one."""
    p = len(batch.prompt_ids[unit[0]])
    fed = sum(max(len(batch.response_ids[i]) - 1, 0) for i in unit) / len(unit)

    def cost(size: int) -> float:
        length = p + size * fed
        return math.ceil(len(unit) / size) * length * (1 + length / width)

    size = min(range(len(unit), 0, -1), key=cost)
    return [unit[lo: lo + size] for lo in range(0, len(unit), size)]


def unit_length(batch: RolloutBatch, unit: list[int]) -> int:
    """The packed sequence's length: the prompt, then each response but its last token."""
    return len(batch.prompt_ids[unit[0]]) + sum(max(len(batch.response_ids[i]) - 1, 0)
                                                for i in unit)


def micro_batches(units: list[list[int]], size: int,
                  length: Callable[[list[int]], int] | None = None,
                  positions: int = 0) -> list[list[list[int]]]:
    """Units into micro-batches of at most `size` rows; a unit larger than `size` is split.
    With `length` and `positions`, also at most that many padded positions (units x the
    longest), which bounds the activations a backward keeps; a longer unit goes alone."""
    chunks = [unit[lo: lo + size] for unit in units for lo in range(0, len(unit), size)]
    out: list[list[list[int]]] = []
    count = longest = 0
    for chunk in chunks:
        n = length(chunk) if length is not None and positions else 0
        if (not out or count + len(chunk) > size
                or (len(out[-1]) + 1) * max(longest, n) > positions > 0):
            out.append([])
            count = longest = 0
        out[-1].append(chunk)
        count += len(chunk)
        longest = max(longest, n)
    return out


class Layout(NamedTuple):
    """One unit's packed sequence before padding; columns count from its start."""
    ids: list[int]
    positions: list[int]
    segments: list[int]  # 0: the prompt, k: the unit's k-th response
    source: list[int]  # per trainable token: the column whose output predicts it
    target: list[int]
    row: list[int]  # the token's row within the unit
    col: list[int]
    pieces: list[tuple[int, int, int, int]]  # routes: (column, batch row, position, count)


def unit_layout(batch: RolloutBatch, unit: list[int]) -> Layout:
    """The prompt, then each response but its last token at the positions that follow the
    prompt; response token t is predicted by the prompt's last column (t = 0) or its own t-1."""
    prompt = batch.prompt_ids[unit[0]]
    p = len(prompt)
    out = Layout(list(prompt), list(range(p)), [0] * p, [], [], [], [], [(0, unit[0], 0, p)])
    for k, i in enumerate(unit):
        resp, start = batch.response_ids[i], len(out.ids)
        for t, (token, trainable) in enumerate(zip(resp, batch.loss_mask[i])):
            if trainable:
                out.source.append(p - 1 if t == 0 else start + t - 1)
                out.target.append(token)
                out.row.append(k)
                out.col.append(t)
        fed = resp[:-1]
        out.ids.extend(fed)
        out.positions.extend(range(p, p + len(fed)))
        out.segments.extend([k + 1] * len(fed))
        out.pieces.append((start, i, p, len(fed)))
    return out


def pack(batch: RolloutBatch, units: list[list[int]], pad_id: int,
         dtype: torch.dtype = torch.float32) -> Packed:
    """The packed sequences of `units` (lists of batch rows sharing a prompt), right-padded to
    the longest; rows are numbered in the order the units list them."""
    layouts = [unit_layout(batch, unit) for unit in units]
    length = max(len(lay.ids) for lay in layouts)
    ids = torch.full((len(units), length), pad_id, dtype=torch.long)
    positions = torch.zeros((len(units), length), dtype=torch.long)
    segments = torch.full((len(units), length), -1, dtype=torch.long)  # -1: padding
    source, target, row, col = [], [], [], []
    first_row = 0
    for n, lay in enumerate(layouts):
        ids[n, :len(lay.ids)] = torch.tensor(lay.ids, dtype=torch.long)
        positions[n, :len(lay.ids)] = torch.tensor(lay.positions, dtype=torch.long)
        segments[n, :len(lay.ids)] = torch.tensor(lay.segments, dtype=torch.long)
        source += [n * length + c for c in lay.source]
        target += lay.target
        row += [first_row + r for r in lay.row]
        col += lay.col
        first_row += len(units[n])
    routes = None
    if any(r is not None for r in batch.routed_experts):
        routes = torch.from_numpy(np.stack([unit_routes(batch, lay.pieces, length)
                                            for lay in layouts]))
    as_long = (lambda v: torch.tensor(v, dtype=torch.long))
    return Packed(ids, positions, block_mask(segments, dtype), routes, as_long(source),
                  as_long(target), as_long(row), as_long(col), segments)


def block_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[units, 1, length, length] additive mask: a column sees the earlier columns of the prompt
    (segment 0) and of its own segment (padding, -1, sees itself: no row is all masked)."""
    col = torch.arange(segments.shape[1])
    seen = (col[None, None, :] <= col[None, :, None]) & (
        (segments[:, None, :] == 0) | (segments[:, None, :] == segments[:, :, None]))
    return torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)[:, None]


def unit_routes(batch: RolloutBatch, pieces: list[tuple[int, int, int, int]],
                length: int) -> np.ndarray:
    """One unit's routes, [length, moe_layers, top_k]: each piece copies `count` positions of a
    batch row's recorded routes from sequence position `position` to `column`; -1 elsewhere."""
    shape = next(r.shape[1:] for r in batch.routed_experts if r is not None)
    out = np.full((length, *shape), -1, dtype=np.int16)
    for column, row, position, count in pieces:
        recorded = batch.routed_experts[row]
        if recorded is None:
            continue
        part = np.asarray(recorded[position: position + count], dtype=np.int16)
        out[column: column + len(part)] = part
    return out


def packed_hidden(model: torch.nn.Module, packed: Packed,
                  route_stats: dict[str, int] | None = None) -> torch.Tensor:
    """The decoder's last hidden states, [units, length, hidden]."""
    replay = (replay_routes(model, packed.routes, route_stats) if packed.routes is not None
              else nullcontext())
    with replay:
        return model.get_decoder()(input_ids=packed.input_ids,
                                   attention_mask=packed.attention_mask,
                                   position_ids=packed.position_ids,
                                   use_cache=False).last_hidden_state


def token_logprobs(model: torch.nn.Module, hidden: torch.Tensor, packed: Packed,
                   temperature: float) -> torch.Tensor:
    """[tokens] log p from the decoder's output: the LM head on the predicting positions only."""
    logits = model.get_output_embeddings()(hidden.flatten(0, 1)[packed.source]).float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, packed.target[:, None])[:, 0]


class Trainer:
    """An HF causal LM taking clipped policy-gradient steps on RolloutBatches."""

    def __init__(self, path: str, lr: float, clip: float, temperature: float,
                 micro_batch: int, dtype: str, pad_id: int, tis: float | None = None,
                 tis_mode: str = "token", micro_positions: int = 4096, exact: bool = False,
                 draft: Callable[[torch.nn.Module], Any] | None = None):
        import transformers

        torch_dtype = torch.float32 if dtype in ("auto", "float32") else getattr(torch, dtype)
        vision = is_vision_language(path)
        if vision and exact:
            raise ValueError("exact logprobs: not for vision-language models")
        auto = (transformers.AutoModelForImageTextToText if vision
                else transformers.AutoModelForCausalLM)
        self.model = auto.from_pretrained(path, dtype=torch_dtype)
        self.model.train()
        # vision-language models: one sample per forward, with its images
        self.vision = VisionScorer(self.model, path) if vision else None
        # fused: one pass over each tensor where the default CPU loop makes six (0.07 against
        # 0.38 s for SmolLM2-135M); the same update up to rounding in the last bit
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0,
                                       fused=True)
        self.clip, self.temperature = clip, temperature
        self.micro_batch, self.pad_id = micro_batch, pad_id
        # a backward keeps ~1.2 MB of activations per position for SmolLM2 in fp32: bound them
        self.micro_positions = micro_positions
        self.tis, self.tis_mode = tis, tis_mode
        # split_unit's attention cost: a dense-mask position costs as much as the layers' matmuls
        # at L ~ 4.5 x hidden size (fitted on SmolLM2's forward and backward on CPU)
        self.pack_width = 4.5 * self.model.config.get_text_config().hidden_size
        # the engine's kernels over this model's parameters (deterministic engines only)
        self.exact = ExactForward(self.model) if exact else None
        # a learned draft's DraftTrainer, made from this model, and what a step gives it
        if draft is not None and vision:
            raise ValueError("a learned draft: not for vision-language models")
        self.draft = draft(self.model) if draft is not None else None
        self._draft_inputs: list[tuple[Packed, torch.Tensor]] = []

    def units(self, batch: RolloutBatch) -> list[list[int]]:
        """The packed sequences of a batch: rows sharing a prompt, split where that is cheaper.
        A vision-language model's are its rows, one sequence each (rollout/vision_forward.py),
        so that --micro-positions bounds what its forwards keep."""
        if self.vision is not None:
            return [[i] for unit in prompt_units(batch) for i in unit]
        return [part for unit in prompt_units(batch)
                for part in split_unit(batch, unit, self.pack_width)]

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        named = [(n, p.detach()) for n, p in self.model.named_parameters()]
        return named + (self.draft.named_tensors() if self.draft is not None else [])

    def response_logprobs(self, batch: RolloutBatch, units: list[list[int]], r_len: int,
                          route_stats: dict[str, int]) -> torch.Tensor:
        """[rows of `units`, r_len] log p of the trainable tokens, 0 elsewhere."""
        if self.vision is not None:
            return self.vision.response_logprobs(batch, [i for unit in units for i in unit],
                                                 r_len, self.temperature)
        packed = pack(batch, units, self.pad_id, self.model.dtype)
        hidden = None
        if self.exact is not None:
            seqs, index = segment_sequences(packed.input_ids, packed.position_ids,
                                            packed.segments)
            flat = self.exact.logprobs(seqs, index.flatten()[packed.source], packed.target,
                                       self.temperature)
        else:
            hidden = packed_hidden(self.model, packed, route_stats)
            flat = token_logprobs(self.model, hidden, packed, self.temperature)
        if self.draft is not None:
            if hidden is None:
                with torch.no_grad():
                    hidden = packed_hidden(self.model, packed)
            self._draft_inputs.append((packed, hidden.detach()))
        out = torch.zeros((sum(map(len, units)), r_len), dtype=flat.dtype)
        return out.index_put((packed.row, packed.col), flat)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step: token-mean clipped surrogate over every trainable token. Without
        --tis the engine's logprobs are the old policy; with it the trainer's own are, and each
        token is weighted by importance_weights(trainer, engine)."""
        t = batch.to_tensors(self.pad_id)
        total = t["loss_mask"].sum().clamp(min=1)
        self.optim.zero_grad()
        sums = {"abs_diff": 0.0, "kl": 0.0, "clipped": 0.0, "loss": 0.0, "truncated": 0.0}
        routes: dict[str, int] = {}
        for units in micro_batches(self.units(batch), self.micro_batch,
                                   lambda unit: unit_length(batch, unit), self.micro_positions):
            index = torch.tensor([i for unit in units for i in unit])
            part = {k: v[index] for k, v in t.items()}
            mask, behavior = part["loss_mask"], part["behavior_logprobs"]
            logp = self.response_logprobs(batch, units, mask.shape[1], routes)
            old, weights = behavior, mask
            if self.tis is not None:
                old = logp.detach()
                iw = importance_weights(old, behavior, mask, self.tis, self.tis_mode)
                weights = iw.weights
                sums["truncated"] += iw.truncated.sum().item()  # of trainable tokens
            ratio = torch.exp(logp - old)
            adv = part["advantages"][:, None]
            surrogate = torch.minimum(ratio * adv,
                                      ratio.clamp(1 - self.clip, 1 + self.clip) * adv)
            loss = -(surrogate * weights).sum() / total
            loss.backward()
            diff = (logp.detach() - behavior) * mask  # the rollout-vs-trainer mismatch
            sums["abs_diff"] += diff.abs().sum().item()
            sums["kl"] += ((torch.exp(-diff) - 1 + diff) * mask).sum().item()  # k3 estimator
            sums["clipped"] += (((ratio - 1).abs() > self.clip).float() * mask).sum().item()
            sums["loss"] += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0).item()
        self.optim.step()
        draft_metrics = self._train_draft()
        n = total.item()
        metrics = {"mismatch/abs_diff": sums["abs_diff"] / n, "mismatch/kl": sums["kl"] / n,
                   "train/clip_fraction": sums["clipped"] / n, "train/loss": sums["loss"],
                   "train/grad_norm": grad_norm}
        if self.tis is not None:
            metrics["mismatch/tis_truncated"] = sums["truncated"] / n
        if routes.get("replayed"):  # routing replay: how often the trainer would have differed
            metrics["mismatch/routes_differ"] = routes["differ"] / routes["replayed"]
        return {**metrics, **draft_metrics}

    def _train_draft(self) -> dict[str, float]:
        """One step of the learned draft on this step's states (module docstring)."""
        inputs, self._draft_inputs = self._draft_inputs, []
        if self.draft is None or not inputs:
            return {}
        units = draft_units(inputs)
        out = self.draft.step(units["input_ids"], units["features"], None, units["loss_mask"],
                              position_ids=units["position_ids"],
                              attention_mask=units["segments"] >= 0,
                              segments=units["segments"])
        return {"draft/loss": out["loss"], "draft/acceptance_est": out["acceptance_estimate"],
                "time/draft_train_s": out["seconds"]}


def draft_units(inputs: list[tuple[Packed, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The step's packed units as the draft's rows, right-padded to the longest: each prompt
    once with its responses continuing it (`segments`), the decoder states beside them, and the
    loss on the positions that predict a response token (the prompt's last, once, and every
    response position: packed rows hold a response without its last token)."""
    length = max(packed.input_ids.shape[1] for packed, _ in inputs)

    def pad(t: torch.Tensor, value: int = 0) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, length - t.shape[1]),
                                       value=value)

    segments = torch.cat([pad(p.segments, -1) for p, _ in inputs])
    loss_mask = segments > 0
    column = torch.arange(length).expand_as(segments)
    last_prompt = torch.where(segments == 0, column, -1).amax(-1)
    rows = (last_prompt >= 0).nonzero().squeeze(1)
    loss_mask[rows, last_prompt[rows]] = True
    return {"input_ids": torch.cat([pad(p.input_ids) for p, _ in inputs]),
            "position_ids": torch.cat([pad(p.position_ids) for p, _ in inputs]),
            "features": torch.cat([pad(h.detach()) for _, h in inputs]),
            "segments": segments, "loss_mask": loss_mask}
