"""Delta weight updates: only the elements that changed since the version the targets serve.

A `DeltaTracker` (the sender's side) keeps what its targets hold: a copy of every tensor in the
weights' dtype (one copy of the weights: 270 MB for SmolLM2-135M in bf16, 538 MB in float32)
and the version that copy was committed as. `encode` rounds the new values to that dtype, as
the engine's own copy would, compares them bit for bit with the copy, and writes each tensor in
the cheapest of four forms:
- none: nothing changed;
- "sparse": int32 flat indices and the values there (few elements changed);
- "blocks": int32 block numbers and the whole blocks of BLOCK elements (changes cluster);
- "full": every element (most changed).
A sample of the copy (every SAMPLE-th element) estimates the changed share first: above DENSE a
full push is cheaper than encoding, the copy is not kept, and the next LOOK_AGAIN - 1 pushes go
full without looking (a float32 engine under AdamW: every element moves, every step).
A `Delta` names the base version it applies to. An engine refuses it unless it serves exactly
that version, and nothing changes; the sender then pushes the full weights (sender.py). Applied
to weights equal to the base, a delta gives the bits a full push of the same tensors would.

On the wire (load_format "delta", sender rank 0 to every other rank): an int64 header
`[n, base_len, index_len, values_len, block, dtype, code_0, count_0, ..., code_n-1, count_n-1]`
(dtype: its place in WIRE_DTYPES), then
the base version (uint8), the indices (int32) and the values (the weights' dtype), each only
when it is not empty.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from hotswap.weight_sync.bucket import TensorSpec, make_specs
from hotswap.weight_sync.group import WeightGroup

NONE, SPARSE, BLOCKS, FULL = 0, 1, 2, 3
BLOCK = 256  # elements per block of the "blocks" form
SAMPLE = 1009  # the estimate looks at every SAMPLE-th element (a prime: no row pattern)
DENSE = 0.3  # an estimated changed share above which a full push costs less than encoding
LOOK_AGAIN = 8  # after dense changes, the push that looks at the samples again
_HEAD = 6
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
logger = logging.getLogger("hotswap.weight_sync")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Delta:
    """The changes of one update against `base_version`: per tensor a form (`codes`) and a
    count (elements for "sparse" and "full", blocks for "blocks"), and two flat buffers."""

    base_version: str
    specs: list[TensorSpec]
    codes: list[int]
    counts: list[int]
    index: torch.Tensor  # int32
    values: torch.Tensor  # the weights' dtype
    block: int = BLOCK

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self.values.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self.specs[0].dtype if self.specs else self.values.dtype

    def changed_elements(self) -> int:
        """Elements whose value differs from the base (a block counts whole)."""
        return sum(self._span(code, count)[1] for code, count in zip(self.codes, self.counts))

    def entries(self) -> Iterator[tuple[TensorSpec, int, torch.Tensor, torch.Tensor]]:
        """(spec, form, its indices, its values) for every tensor that changed."""
        at_index = at_values = 0
        for spec, code, count in zip(self.specs, self.codes, self.counts):
            indices, values = self._span(code, count)
            if code != NONE:
                yield (spec, code, self.index[at_index: at_index + indices],
                       self.values[at_values: at_values + values])
            at_index += indices
            at_values += values

    def _span(self, code: int, count: int) -> tuple[int, int]:
        """(indices, values) a tensor takes in the flat buffers."""
        if code == SPARSE:
            return count, count
        if code == BLOCKS:
            return count, count * self.block
        return 0, count if code == FULL else 0

    def non_finite(self) -> list[str]:
        """Names whose new values hold NaN or inf."""
        if not self.values.is_floating_point():
            return []
        return [spec.name for spec, _, _, values in self.entries()
                if not bool(torch.isfinite(values).all())]

    def apply(self, views: Mapping[str, torch.Tensor]) -> None:
        """Write the changes into `views` (name -> the tensor the base values live in)."""
        with torch.no_grad():
            for spec, code, index, values in self.entries():
                dest = views[spec.name]
                flat = dest.view(-1) if dest.is_contiguous() else dest.contiguous().view(-1)
                _apply_one(flat, code, index, values, self.block)
                if flat.data_ptr() != dest.data_ptr():
                    dest.copy_(flat.view(dest.shape))

    def header(self) -> torch.Tensor:
        base = self.base_version.encode()
        head = [len(self.specs), len(base), self.index.numel(), self.values.numel(), self.block,
                WIRE_DTYPES.index(self.values.dtype)]
        head += [v for pair in zip(self.codes, self.counts) for v in pair]
        return torch.tensor(head, dtype=torch.int64)

    def broadcast(self, group: WeightGroup) -> None:
        """Sender (rank 0): the delta on the wire."""
        device = group.device
        group.broadcast(self.header().to(device))
        for part in (_bytes(self.base_version), self.index, self.values):
            if part.numel():
                group.broadcast(part.to(device).contiguous())


def receive_delta(group: WeightGroup, names: Sequence[str], dtypes: Sequence[str | torch.dtype],
                  shapes: Sequence[Sequence[int]]) -> Delta:
    """Receiver: the delta a sender broadcast for these tensors. The whole broadcast is
    consumed first; then a ValueError if it does not fit them (count, dtype, indices)."""
    specs = make_specs(names, dtypes, shapes)
    head = torch.zeros(_HEAD + 2 * len(specs), dtype=torch.int64, device=group.device)
    group.broadcast(head)
    n, base_len, index_len, values_len, block, dtype = (int(v) for v in head[:_HEAD].tolist())
    pairs = head[_HEAD:].view(-1, 2).tolist()
    parts = []
    for numel, kind in ((base_len, torch.uint8), (index_len, torch.int32),
                        (values_len, WIRE_DTYPES[dtype])):
        part = torch.empty(numel, dtype=kind, device=group.device)
        if numel:
            group.broadcast(part)
        parts.append(part.cpu())
    delta = Delta(bytes(parts[0].tolist()).decode(), specs, [c for c, _ in pairs],
                  [k for _, k in pairs], parts[1], parts[2], block)
    if n != len(specs) or any(s.dtype != delta.values.dtype for s in specs):
        raise ValueError(f"the delta ({n} tensor(s) of {delta.values.dtype}) does not match "
                         "the update's names and dtypes")
    if delta.index.numel() != sum(delta._span(c, k)[0] for c, k in pairs) or \
            delta.values.numel() != sum(delta._span(c, k)[1] for c, k in pairs):
        raise ValueError("the delta's header does not match its buffers")
    check_delta(delta)
    return delta


def discard_delta(group: WeightGroup, names: Sequence[str],
                  dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]]) -> None:
    """Take part in a delta broadcast and drop it (a refused update)."""
    with contextlib.suppress(ValueError):  # consumed all the same: the header said how much
        receive_delta(group, names, dtypes, shapes)


class DeltaTracker:
    """What the targets hold, to encode the next update against: one copy of the weights in
    their dtype and the version it was committed as (None before the first full push), and a
    sample of it (every SAMPLE-th element) that estimates, cheaply, how much changed."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.base_version: str | None = None
        self._base: dict[str, torch.Tensor] = {}
        self._sample: dict[str, torch.Tensor] = {}
        self.last_estimate: float | None = None  # the changed share plan() estimated
        self._skip = 0  # pushes left to go full without looking (changes were dense)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._base.values())

    def can_encode(self, names: Iterable[str]) -> bool:
        return self.base_version is not None and all(n in self._base for n in names)

    def estimate(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> float | None:
        """The share of elements that changed, from the samples (None: no sample yet)."""
        if any(name not in self._sample for name, _ in tensors):
            return None

        def changed(named: tuple[str, torch.Tensor]) -> tuple[int, int]:
            new, old = _sample(named[1], self.dtype), self._sample[named[0]]
            bits = _BITS[new.element_size()]
            return int(torch.count_nonzero(new.view(bits) != old.view(bits))), new.numel()

        counts = _each(changed, tensors)
        return sum(c for c, _ in counts) / max(sum(n for _, n in counts), 1)

    def plan(self, tensors: Sequence[tuple[str, torch.Tensor]], served: set[str]
             ) -> tuple[Delta, list] | None:
        """The delta to push to targets serving `served`, with the values it leaves them
        (`committed` takes them); None when a full push is due: no base yet, targets on
        another version, or changes dense enough that encoding costs more than it saves
        (then the next LOOK_AGAIN - 1 pushes go full without looking)."""
        self.last_estimate = None
        if self._skip:
            self._skip -= 1
            return None
        self.last_estimate = self.estimate(tensors)
        if self.last_estimate is None or self.last_estimate > DENSE:
            return None
        if not self.can_encode(n for n, _ in tensors) or served != {self.base_version}:
            return None
        return self.encode(tensors)

    def after_full(self, version: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """After a full push: keep the copy where deltas may pay; where changes are dense keep
        nothing, but sample the push before the next look (it compares with that)."""
        estimate = self.last_estimate
        if estimate is not None and estimate > DENSE:
            self._skip = LOOK_AGAIN - 1
        if not self._sample or (estimate is not None and estimate <= DENSE):
            self.committed_full(version, tensors, keep=True)
        elif self._skip == 0:
            self.committed_full(version, tensors, keep=False)
        else:
            self._base.clear()
            self.base_version = version

    def encode(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[Delta, list]:
        """The delta of `tensors` (rounded to the weights' dtype) against the base, and the
        rounded tensors, which become the base once the targets commit (`committed`)."""
        assert self.base_version is not None
        parts = _each(self._encode_tensor, tensors)
        delta = Delta(self.base_version, [p[0] for p in parts], [p[1] for p in parts],
                      [p[2] for p in parts], _cat([p[3] for p in parts], torch.int32),
                      _cat([p[4] for p in parts], self.dtype))
        return delta, [(p[0].name, p[5]) for p in parts]

    def _encode_tensor(self, named: tuple[str, torch.Tensor]) -> tuple:
        name, tensor = named
        # A copy even where the dtype is the same: the trainer steps its tensors in place.
        new = tensor.detach().to("cpu", self.dtype, copy=True).contiguous()
        code, index, values = _encode_one(self._base[name].view(-1), new.view(-1))
        count = index.numel() if code in (SPARSE, BLOCKS) else values.numel()
        return TensorSpec(name, self.dtype, tuple(new.shape)), code, count, index, values, new

    def committed(self, version: str, rounded: Sequence[tuple[str, torch.Tensor]]) -> None:
        """The targets now serve `version`, holding these values (rounded to the dtype)."""
        samples = _each(lambda named: _sample(named[1], self.dtype), rounded)
        for (name, tensor), sample in zip(rounded, samples):
            self._base[name] = tensor
            self._sample[name] = sample
        self.base_version = version

    def committed_full(self, version: str, tensors: Sequence[tuple[str, torch.Tensor]],
                       keep: bool = True) -> None:
        """After a full push of these (trainer) tensors. keep=False keeps only the samples
        (changes are dense: the copy would cost a pass over the weights for nothing); the
        next push is then full, and keeps the copy if the samples say deltas pay again."""
        if keep:
            self.committed(version, _each(lambda named: (named[0], named[1].detach().to(
                "cpu", self.dtype, copy=True)), tensors))
            return
        self._base.clear()
        samples = _each(lambda named: _sample(named[1], self.dtype), tensors)
        self._sample.update((name, s) for (name, _), s in zip(tensors, samples))
        self.base_version = version

    def forget(self) -> None:
        """The targets' state is unknown (a failed push): the next push is full."""
        self.base_version = None


def update_in_process(target: Any, tensors: Sequence[tuple[str, torch.Tensor]],
                      tracker: DeltaTracker, weight_version: str | None = None,
                      pause_mode: str = "retract") -> tuple[dict, dict]:
    """`target.update_weights_from_tensor` (an Engine in this process) with only what changed
    since the tracker's base, or in full when a delta does not apply or is refused. Returns
    the target's reply and what was pushed ({"kind", "bytes", "changed_fraction"})."""
    planned = tracker.plan(tensors, {str(target.get_weight_version())})
    if planned is not None:
        delta, rounded = planned
        try:
            reply = target.update_weights_from_tensor(delta, load_format="delta",
                                                      weight_version=weight_version,
                                                      pause_mode=pause_mode)
        except ValueError as err:
            reply = {"success": False, "message": str(err)}
        if reply.get("success"):
            tracker.committed(str(reply["weight_version"]), rounded)
            return reply, delta_stats(delta)
        logger.warning("delta update refused (%s); updating in full", reply.get("message"))
    tracker.forget()
    reply = target.update_weights_from_tensor(list(tensors), weight_version=weight_version,
                                              pause_mode=pause_mode)
    if reply.get("success"):
        tracker.after_full(str(reply["weight_version"]), tensors)
    return reply, full_stats(tracker, tensors)


def delta_stats(delta: Delta) -> dict[str, Any]:
    total = sum(s.numel for s in delta.specs)
    return {"kind": "delta", "bytes": delta.nbytes,
            "changed_fraction": delta.changed_elements() / max(total, 1)}


def full_stats(tracker: DeltaTracker, tensors: Iterable[tuple[str, torch.Tensor]]
               ) -> dict[str, Any]:
    estimate = tracker.last_estimate
    return {"kind": "full", "bytes": sum(t.nbytes for _, t in tensors),
            "changed_fraction": 1.0 if estimate is None else estimate}


def _each(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """fn over items on a pool of single-threaded workers: beside a trainer's threads, one
    OpenMP team over each tensor's small ops is far slower (SmolLM2's encode measured 0.23-0.45 s
    this way against 2.5-6.7 s on a busy 2-core machine)."""
    def one(item: Any) -> Any:
        torch.set_num_threads(1)  # this worker thread's own setting
        return fn(item)

    with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), len(items)))) as pool:
        return list(pool.map(one, items))


def _sample(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.detach().reshape(-1)[::SAMPLE].to("cpu", dtype, copy=True)


def _encode_one(old: torch.Tensor, new: torch.Tensor
                ) -> tuple[int, torch.Tensor, torch.Tensor]:
    bits = _BITS[new.element_size()]
    changed = new.view(bits) != old.view(bits)
    count = int(torch.count_nonzero(changed))
    empty = torch.empty(0, dtype=torch.int32)
    if count == 0:
        return NONE, empty, new[:0]
    numel, size = new.numel(), new.element_size()
    nblocks = math.ceil(numel / BLOCK)
    index = None
    if count * (4 + size) < numel * size:  # indices may pay: they also give the blocks
        index = changed.nonzero().view(-1)
        blocks = torch.unique_consecutive(index // BLOCK)
    else:
        padded = torch.nn.functional.pad(changed, (0, nblocks * BLOCK - numel))
        blocks = padded.view(nblocks, BLOCK).any(1).nonzero().view(-1)
    costs = {FULL: numel * size, BLOCKS: blocks.numel() * (4 + BLOCK * size)}
    if index is not None:
        costs[SPARSE] = count * (4 + size)
    code = min(costs, key=costs.__getitem__)
    if code == FULL:
        return FULL, empty, new
    if code == SPARSE:
        return SPARSE, index.to(torch.int32), new[index]
    rows = torch.nn.functional.pad(new, (0, nblocks * BLOCK - numel)).view(nblocks, BLOCK)
    return BLOCKS, blocks.to(torch.int32), rows[blocks].reshape(-1)


def _apply_one(flat: torch.Tensor, code: int, index: torch.Tensor, values: torch.Tensor,
               block: int) -> None:
    if code == FULL:
        flat.copy_(values)
    elif code == SPARSE:
        flat.index_copy_(0, index.to(torch.long), values.to(flat.dtype))
    else:
        rows = values.view(-1, block)
        full = flat.numel() // block
        last = index.to(torch.long)
        inside = last < full
        if bool(inside.any()):
            flat[: full * block].view(full, block).index_copy_(0, last[inside],
                                                               rows[inside].to(flat.dtype))
        if not bool(inside.all()):  # the last, partial block
            start = full * block
            flat[start:].copy_(rows[~inside][0, : flat.numel() - start])


def check_delta(delta: Delta) -> None:
    """Every index within its tensor: a corrupt delta is refused before any write."""
    for spec, code, index, values in delta.entries():
        limit = spec.numel if code == SPARSE else math.ceil(spec.numel / delta.block)
        if code == FULL and values.numel() != spec.numel:
            raise ValueError(f"the delta's values for {spec.name!r} do not fill it")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= limit):
            raise ValueError(f"the delta's indices for {spec.name!r} fall outside it")


def _bytes(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
