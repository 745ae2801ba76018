"""Receiving a distributed update (one engine, no tensor parallelism) before it is installed.

With staging "standby" (the default) the tensors land in the standby buffer (standby.py) while
the engine keeps serving; each one's values are checked as it lands, while the next is still on
the wire, and a NaN or inf refuses the whole update before anything live is written. Installing
is then a swap of buffers at commit. Staging "none" receives in place instead, in the scheduler
thread with generation paused (fastest, no extra memory; a non-finite tensor is found after the
write and leaves the engine refusing generation until a complete update, docs/design.md).

Tensors sent in another dtype than the weights' (an fp32 trainer, a bf16 engine) are converted
into their destination as they land (weight_sync/receiver.py), through the landing buffers the
standby keeps, either staging; the check reads the converted values, what the engine will serve
(a finite fp32 value beyond the bf16 or fp16 range rounds to inf and is refused).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field

import torch

from hotswap.engine.models.llama import WeightSlot
from hotswap.engine.models.loader import is_finite, is_ignored, write_weights
from hotswap.engine.weights.standby import Standby
from hotswap.weight_sync.group import WeightGroup
from hotswap.weight_sync.receiver import Landing, receive_tensors


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """This thread's torch ops on one core while an update is received: beside the transport's
    threads and another OpenMP team, a second team oversubscribes the cores and each parallel op
    waits on a descheduled peer (the finite check of SmolLM2 took 2 s instead of 0.04 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per thread: the OpenMP and MKL settings of this thread only
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Stages:
    """Seconds spent in each stage of one update, in order (bench/weight_sync.py prints them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        """Charge the time since the previous lap to `stage`."""
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now


@dataclass
class Landed:
    """A received, checked update waiting to be installed, and the standby it holds."""

    names: list[str]
    weight_map: dict[str, WeightSlot]
    standby: Standby | None  # None: the tensors are in `tensors` (no one-buffer layout)
    lease: Standby | None = None  # the engine's own standby while this holds it (drop frees)
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def install(self) -> None:
        """Scheduler thread, generation paused: the update becomes the live weights."""
        if self.standby is None:
            write_weights(self.weight_map, self.tensors)
        else:
            self.standby.install(self.names)

    def drop(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self.standby, self.lease, self.tensors = None, None, []


def receive_to_standby(standby: Standby, group: WeightGroup, names: Sequence[str],
                       dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                       load_format: str | None, check_finite: bool, stages: Stages) -> Landed:
    """Receive the whole update off the live weights, checking each tensor as it lands; a
    ValueError (after the broadcast is consumed) names every non-finite tensor."""
    lease = standby if standby.acquire() else None
    held = lease or Standby(standby.runner)  # busy: a one-off buffer
    landed = Landed(list(names), standby.weight_map, held, lease)
    try:
        views = held.views(names)
        stages.lap("standby")
        bad: list[str] = []
        with closing(receive_tensors(group, names, dtypes, shapes, load_format,
                                     device=group.device, into=views,
                                     landing=held.landing)) as received:
            for name, tensor in _timed(received, stages):
                if is_ignored(name):
                    continue
                if check_finite and not is_finite(tensor):
                    bad.append(name)
                stages.lap("check")
                if views is None:
                    landed.tensors.append((name, tensor.clone()))
        if views is None:
            landed.standby = None
        if bad:
            raise ValueError(non_finite_message(bad))
    except BaseException:
        landed.drop()
        raise
    return landed


def receive_in_place(group: WeightGroup, weight_map: dict, names: Sequence[str],
                     dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                     load_format: str | None, check_finite: bool, device: torch.device,
                     stages: Stages, landing: Landing) -> None:
    """Scheduler thread, generation paused: the tensors land in the parameters (through
    `landing` when converted); a non-finite one raises after its write (the caller marks the
    weights incomplete)."""
    into = {n: weight_map[n].view for n in names if not is_ignored(n)}
    into = {n: v for n, v in into.items() if v.device.type != "meta"}
    bad: list[str] = []
    with closing(receive_tensors(group, names, dtypes, shapes, load_format, device=device,
                                 into=into, landing=landing)) as received:
        for name, tensor in _timed(received, stages):
            if is_ignored(name):
                continue
            if check_finite and not is_finite(tensor):
                bad.append(name)
            stages.lap("check")
            if name not in into:
                write_weights(weight_map, [(name, tensor)])
    if bad:
        raise ValueError(non_finite_message(bad))


def non_finite_message(bad: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return f"tensor(s) {shown}{more} hold non-finite values (NaN or inf)"


def _timed(received: Iterator[tuple[str, torch.Tensor]], stages: Stages
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The received tensors, the wait for each (and its conversion) charged to "receive"."""
    for item in received:
        stages.lap("receive")
        yield item
