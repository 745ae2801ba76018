"""Receiver (engine) side: named tensors out of the broadcasts a WeightSender makes.

The wire protocol, sender rank 0 to every other rank:
- load_format None: one broadcast per tensor, in the order of `names`.
- load_format "flattened_bucket": an int64 header of len(names) entries (the tensor count of each
  bucket, zero-padded), then one broadcast per flat bucket. The header spares the two sides any
  agreement on bucket_bytes.
- load_format "delta": the changes against a base version (delta.py; receive_delta).

A destination of another floating dtype than the wire's (an fp32 trainer, a bf16 engine) is
converted into as each tensor or bucket lands, while the next one is on the wire; the bytes land
first in one of two Landing buffers, which a caller may keep across updates (fresh memory is
paged in by the receive itself: a 512 MB bucket took 0.35-0.7 s into fresh memory, 0.12-0.2 s
into kept memory).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence

import torch

from hotswap.weight_sync.bucket import (
    Bucket,
    TensorSpec,
    buckets_from_counts,
    header_counts,
    make_specs,
    unflatten,
)
from hotswap.weight_sync.delta import discard_delta
from hotswap.weight_sync.group import WeightGroup, WeightSyncError, get_group

LOAD_FORMATS = (None, "flattened_bucket", "delta")
log = logging.getLogger(__name__)

Received = Iterator[tuple[str, torch.Tensor]]


class Landing:
    """Two reusable byte buffers where tensors land before they are converted into their
    destinations (the second is filled while the first is converted). Each grows to the largest
    bucket or tensor it takes and is kept until free()."""

    def __init__(self) -> None:
        self._slots: list[torch.Tensor | None] = [None, None]

    def get(self, slot: int, nbytes: int, dtype: torch.dtype, device: torch.device
            ) -> torch.Tensor:
        """A flat `dtype` tensor of `nbytes` bytes in buffer `slot` (0 or 1)."""
        buf = self._slots[slot]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            self._slots[slot] = None  # the old one goes before the new one is paged in
            self._slots[slot] = buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._slots if b is not None)

    def free(self) -> None:
        self._slots = [None, None]


def check_load_format(load_format: str | None) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")


def receive_tensors(
    group: WeightGroup | str,
    names: Sequence[str],
    dtypes: Sequence[str | torch.dtype],
    shapes: Sequence[Sequence[int]],
    load_format: str | None = None,
    device: torch.device | str | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    landing: Landing | None = None,
) -> Received:
    """Yields (name, tensor) in the order of `names` as each lands.

    Arguments are checked now; nothing is received until the first next(). `into` holds
    preallocated destinations (contiguous, same shape; the same dtype, or for a floating tensor
    another floating dtype, converted into as torch's copy_ rounds: to nearest even); a yielded
    tensor is then that destination. Same-dtype destinations on the group's device are broadcast
    into straight (per tensor, or per bucket when a bucket's lie back to back); others are
    converted from `landing` (default: buffers for this call only). Other tensors are yielded on
    `device` (default: the group's), possibly as views into a bucket. Consume it to the end: that
    keeps this rank in step with the sender. Closed early (use contextlib.closing), it receives
    and discards the rest so the group stays usable. Transport failures raise WeightSyncError.
    """
    if isinstance(group, str):
        group = get_group(group)
    check_load_format(load_format)
    if load_format == "delta":
        raise ValueError("a delta update is received with receive_delta (weight_sync/delta.py)")
    specs = make_specs(names, dtypes, shapes)
    dests = _check_into(into or {}, specs)
    out = torch.device(device) if device is not None else group.device
    landing = landing or Landing()
    if load_format is None:
        return _per_tensor(group, specs, out, dests, landing)
    return _bucketed(group, specs, out, dests, landing)


def discard_tensors(
    group: WeightGroup | str,
    names: Sequence[str],
    dtypes: Sequence[str | torch.dtype],
    shapes: Sequence[Sequence[int]],
    load_format: str | None = None,
) -> None:
    """Takes part in an update and drops it. An engine that rejects an update calls this, so the
    sender finishes at once (instead of timing out) and the group stays in step."""
    if load_format == "delta":
        if isinstance(group, str):
            group = get_group(group)
        discard_delta(group, names, dtypes, shapes)
        return
    for _ in receive_tensors(group, names, dtypes, shapes, load_format):
        pass


def _check_into(into: Mapping[str, torch.Tensor], specs: list[TensorSpec]) -> dict:
    dests = {}
    for spec in specs:
        dest = into.get(spec.name)
        if dest is None:
            continue
        converts = dest.dtype.is_floating_point and spec.dtype.is_floating_point
        if (dest.dtype != spec.dtype and not converts) or tuple(dest.shape) != spec.shape:
            raise ValueError(
                f"destination of {spec.name!r} is {dest.dtype} {tuple(dest.shape)}, the update "
                f"sends {spec.dtype} {spec.shape}"
            )
        if not dest.is_contiguous():
            raise ValueError(f"destination of {spec.name!r} is not contiguous")
        dests[spec.name] = dest
    return dests


def _per_tensor(
    group: WeightGroup, specs: list[TensorSpec], out: torch.device, dests: dict,
    landing: Landing,
) -> Received:
    """Tensor k+1 is on the wire while tensor k is handed out (each has its own buffer; a
    tensor converted into its destination lands in landing buffer k % 2, free again by then)."""

    def start(i: int) -> tuple[torch.Tensor, object]:
        spec = specs[i]
        dest = dests.get(spec.name)
        if dest is not None and dest.device == group.device and dest.dtype == spec.dtype:
            buf = dest
        elif dest is not None:
            buf = landing.get(i % 2, spec.nbytes, spec.dtype, group.device).view(spec.shape)
        else:
            buf = _empty(spec, group.device)
        return buf, group.broadcast_start(buf)

    started, work = 0, None
    try:
        for i, spec in enumerate(specs):
            if started == i:
                buf, work = start(i)
                started += 1
            group.wait(work)
            current, work = buf, None
            if started < len(specs):
                buf, work = start(started)
                started += 1
            yield spec.name, _deliver(current, dests.get(spec.name), out)
    except GeneratorExit:
        if work is not None:
            group.wait(work)
        _drain(group, [Bucket(s.dtype, (s,)) for s in specs[started:]])
        raise


def _bucketed(
    group: WeightGroup, specs: list[TensorSpec], out: torch.device, dests: dict,
    landing: Landing,
) -> Received:
    """Bucket k+1 is on the wire while bucket k is copied out (double buffering). A bucket whose
    tensors all have destinations lands in landing buffer k % 2: nothing of it escapes."""
    if not specs:
        return
    header = torch.zeros(len(specs), dtype=torch.int64, device=group.device)
    group.broadcast(header)
    buckets = buckets_from_counts(specs, header_counts(header.cpu()))

    def start(i: int) -> tuple[torch.Tensor, object, torch.Tensor | None]:
        """The bucket's buffer, its broadcast, and the span of its destinations (if they lie
        back to back): received straight into when of the wire's dtype, else converted into."""
        bucket = buckets[i]
        span = _contiguous_span([dests.get(s.name) for s in bucket.specs], group.device)
        if span is not None and span.dtype == bucket.dtype:
            flat = span
        elif all(s.name in dests for s in bucket.specs):
            flat = landing.get(i % 2, bucket.nbytes, bucket.dtype, group.device)
        else:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=group.device)
        return flat, group.broadcast_start(flat), span

    started = 1
    flat, work, span = start(0)
    try:
        for bucket in buckets:
            group.wait(work)
            current, current_span, work = flat, span, None
            if started < len(buckets):
                flat, work, span = start(started)
                started += 1
            if current_span is not None and current_span.data_ptr() != current.data_ptr():
                current_span.copy_(current)  # one conversion for the whole bucket
                current = current_span
            views = unflatten(current.to(out), bucket.specs)
            for spec, view in zip(bucket.specs, views, strict=True):
                yield spec.name, _deliver(view, dests.get(spec.name), out)
    except GeneratorExit:
        if work is not None:
            group.wait(work)
        _drain(group, buckets[started:])
        raise


def _contiguous_span(dests: list[torch.Tensor | None], device: torch.device
                     ) -> torch.Tensor | None:
    """A flat view over `dests` when they are contiguous and back to back in one storage."""
    if any(d is None or d.device != device or not d.is_contiguous() for d in dests):
        return None
    first = dests[0]
    storage, expected = first.untyped_storage().data_ptr(), first.data_ptr()
    for d in dests:
        if d.untyped_storage().data_ptr() != storage or d.data_ptr() != expected:
            return None
        expected += d.numel() * d.element_size()
    total = sum(d.numel() for d in dests)
    return first.as_strided((total,), (1,), first.storage_offset())


def _deliver(buf: torch.Tensor, dest: torch.Tensor | None, out: torch.device) -> torch.Tensor:
    if dest is None:
        return buf.to(out)
    if buf.data_ptr() != dest.data_ptr():
        dest.copy_(buf)
    return dest


def _empty(spec: TensorSpec, device: torch.device) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=spec.dtype, device=device)


def _drain(group: WeightGroup, buckets: list[Bucket]) -> None:
    try:
        for bucket in buckets:
            group.broadcast(torch.empty(bucket.numel, dtype=bucket.dtype, device=group.device))
    except WeightSyncError as err:  # raising from close() would only be printed and ignored
        log.warning("discarding the rest of an update failed: %s", err)
