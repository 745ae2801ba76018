"""A standby copy of the weight storage: where a distributed update lands before it is installed.

The model runner lays every parameter out in one flat buffer (ModelRunner._flatten_parameters).
A Standby is a second buffer of the same layout, allocated once and kept, so an update is received
into memory that is already paged in, checked (finite values) while the engine keeps serving the
old weights, and installed at commit by pointing the parameters at it (a swap: no copy). The
buffer they leave becomes the next standby. A small update (under half the weights) is copied in
instead, since a swap would first have to copy everything it does not cover. The price is one
extra copy of the weights in memory, from the first update on (docs/performance.md), and, for
updates sent in another dtype than the weights' (fp32 into bf16), two landing buffers of one
bucket (or, per tensor, of the largest tensor) each, where they land before conversion.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from hotswap.engine.layers import cpu_kernels
from hotswap.engine.models.llama import WeightSlot
from hotswap.engine.models.loader import is_ignored
from hotswap.weight_sync.receiver import Landing

if TYPE_CHECKING:
    from hotswap.engine.executor.model_runner import ModelRunner


class Standby:
    """The second buffer, and who holds it: one update at a time (acquire / release)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.flat: torch.Tensor | None = None
        self.landing = Landing()  # kept too: fresh pages would be faulted in by the receive
        self._lock = threading.Lock()

    @property
    def weight_map(self) -> dict[str, WeightSlot]:
        return self.runner.weight_map

    def acquire(self) -> bool:
        """Take the standby for one update; False when another update holds it."""
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def borrow_landing(self) -> Iterator[Landing]:
        """The kept landing buffers for an update received in place, or one-off ones while an
        update holds the standby."""
        if not self.acquire():
            yield Landing()
            return
        try:
            yield self.landing
        finally:
            self.release()

    def free(self) -> None:
        """Give the buffer's memory back (release_memory_occupation), unless an update holds
        it; the next update allocates it again."""
        if self.acquire():
            self.flat = None
            self.landing.free()
            self.release()

    def live(self) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """(the flat buffer every parameter lives in, the parameters); None when they are not
        laid out in one buffer (released weights, a tensor-parallel shard map)."""
        if not all(isinstance(s, WeightSlot) for s in self.weight_map.values()):
            return None
        params = list({id(s.param): s.param for s in self.weight_map.values()}.values())
        if not params or any(p.device.type == "meta" or not p.data.is_contiguous()
                             for p in params):
            return None
        storage = params[0].untyped_storage()
        if any(p.untyped_storage().data_ptr() != storage.data_ptr() for p in params):
            return None
        first = params[0].data
        flat = torch.empty(0, dtype=first.dtype, device=first.device).set_(storage)
        if flat.numel() != sum(p.numel() for p in params):
            return None
        return flat, params

    def views(self, names: Iterable[str]) -> dict[str, torch.Tensor] | None:
        """Where each named tensor lands in the standby (its place in the live layout); None
        when the weights are not in one buffer. Allocates the standby the first time."""
        live = self.live()
        if live is None:
            return None
        flat, _ = live
        if self.flat is None or self.flat.numel() != flat.numel() or self.flat.dtype != flat.dtype:
            self.flat = cpu_kernels.huge_empty(tuple(flat.shape), flat.dtype, flat.device)
        base = flat.data_ptr()
        out = {}
        for name in names:
            if is_ignored(name):
                continue
            view = self.weight_map[name].view
            offset = (view.data_ptr() - base) // view.element_size()
            out[name] = self.flat[offset: offset + view.numel()].view(view.shape)
        return out

    def install(self, names: Sequence[str]) -> str:
        """Scheduler thread, generation paused: make the standby's `names` the live weights.
        Returns "swap" or "copy" (what it did)."""
        live = self.live()
        if live is None or self.flat is None or self.flat.numel() != live[0].numel():
            raise RuntimeError("the weights were released or re-laid out after the update was "
                               "received; nothing was written")
        flat, params = live
        spans = _spans(flat, [self.weight_map[n].view for n in names if not is_ignored(n)])
        covered = sum(end - start for start, end in spans)
        with torch.no_grad():
            if 2 * covered < flat.numel():
                for start, end in spans:
                    flat[start:end].copy_(self.flat[start:end])
                return "copy"
            for start, end in _gaps(spans, flat.numel()):  # what the update leaves as it was
                self.flat[start:end].copy_(flat[start:end])
            for p in params:
                offset = p.data.storage_offset()
                p.data = self.flat[offset: offset + p.numel()].view(p.shape)
        self.flat = flat
        return "swap"


def _spans(flat: torch.Tensor, views: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The element ranges of `flat` the views cover, sorted and merged."""
    base, size = flat.data_ptr(), flat.element_size()
    spans = sorted(((v.data_ptr() - base) // size, (v.data_ptr() - base) // size + v.numel())
                   for v in views)
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _gaps(spans: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    gaps, at = [], 0
    for start, end in spans:
        if start > at:
            gaps.append((at, start))
        at = end
    if at < total:
        gaps.append((at, total))
    return gaps
