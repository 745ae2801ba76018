"""Receiver (engine) side: named tensors out of the broadcasts a WeightSender makes.

The wire protocol, sender rank 0 to every other rank:
- load_format None: one broadcast per tensor, in the order of `names`.
- load_format "flattened_bucket": an int64 header of len(names) entries (the tensor count of each
  bucket, zero-padded), then one broadcast per flat bucket. The header spares the two sides any
  agreement on bucket_bytes.
- load_format "delta": the changes against a base version (delta.py; receive_delta).
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
) -> Received:
    """Yields (name, tensor) in the order of `names` as each lands.

    Arguments are checked now; nothing is received until the first next(). `into` holds
    preallocated destinations (contiguous, same dtype and shape); a yielded tensor is then that
    destination, and per-tensor format broadcasts straight into it when it is on the group's
    device. Other tensors are yielded on `device` (default: the group's), possibly as views into a
    bucket. Consume it to the end: that keeps this rank in step with the sender. Closed early (use
    contextlib.closing), it receives and discards the rest so the group stays usable.
    Transport failures raise WeightSyncError.
    """
    if isinstance(group, str):
        group = get_group(group)
    check_load_format(load_format)
    if load_format == "delta":
        raise ValueError("a delta update is received with receive_delta (weight_sync/delta.py)")
    specs = make_specs(names, dtypes, shapes)
    dests = _check_into(into or {}, specs)
    out = torch.device(device) if device is not None else group.device
    if load_format is None:
        return _per_tensor(group, specs, out, dests)
    return _bucketed(group, specs, out, dests)


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
        if dest.dtype != spec.dtype or tuple(dest.shape) != spec.shape:
            raise ValueError(
                f"destination of {spec.name!r} is {dest.dtype} {tuple(dest.shape)}, the update "
                f"sends {spec.dtype} {spec.shape}"
            )
        if not dest.is_contiguous():
            raise ValueError(f"destination of {spec.name!r} is not contiguous")
        dests[spec.name] = dest
    return dests


def _per_tensor(
    group: WeightGroup, specs: list[TensorSpec], out: torch.device, dests: dict
) -> Received:
    """Tensor k+1 is on the wire while tensor k is handed out (each has its own buffer)."""

    def start(spec: TensorSpec) -> tuple[torch.Tensor, object]:
        dest = dests.get(spec.name)
        direct = dest is not None and dest.device == group.device
        buf = dest if direct else _empty(spec, group.device)
        return buf, group.broadcast_start(buf)

    started, work = 0, None
    try:
        for i, spec in enumerate(specs):
            if started == i:
                buf, work = start(spec)
                started += 1
            group.wait(work)
            current, work = buf, None
            if started < len(specs):
                buf, work = start(specs[started])
                started += 1
            yield spec.name, _deliver(current, dests.get(spec.name), out)
    except GeneratorExit:
        if work is not None:
            group.wait(work)
        _drain(group, [Bucket(s.dtype, (s,)) for s in specs[started:]])
        raise


def _bucketed(
    group: WeightGroup, specs: list[TensorSpec], out: torch.device, dests: dict
) -> Received:
    """Bucket k+1 is on the wire while bucket k is copied out (double buffering). A bucket whose
    tensors all have destinations lands in one of two reused buffers: nothing of it escapes."""
    if not specs:
        return
    header = torch.zeros(len(specs), dtype=torch.int64, device=group.device)
    group.broadcast(header)
    buckets = buckets_from_counts(specs, header_counts(header.cpu()))
    pool: list[torch.Tensor | None] = [None, None]

    def start(i: int) -> tuple[torch.Tensor, object]:
        bucket = buckets[i]
        span = _contiguous_span([dests.get(s.name) for s in bucket.specs], group.device)
        if span is not None:
            flat = span  # the destinations lie back to back: receive straight into them
        elif all(s.name in dests for s in bucket.specs):
            flat = _pooled(pool, i % 2, bucket, group.device)
        else:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=group.device)
        return flat, group.broadcast_start(flat)

    started = 1
    flat, work = start(0)
    try:
        for bucket in buckets:
            group.wait(work)
            current, work = flat, None
            if started < len(buckets):
                flat, work = start(started)
                started += 1
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


def _pooled(pool: list[torch.Tensor | None], slot: int, bucket: Bucket,
            device: torch.device) -> torch.Tensor:
    buf = pool[slot]
    if buf is None or buf.numel() < bucket.nbytes:
        buf = pool[slot] = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    return buf[: bucket.nbytes].view(bucket.dtype)


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
