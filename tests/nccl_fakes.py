"""A fake torch.distributed.ProcessGroupNCCL (and CUDA presence) for the NCCL branches on CPU."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


class FakeWork:
    def __init__(self, done: bool):
        self.done, self.waited = done, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.waited = True
        return True


class FakeNCCL:
    """Records what the code under test asks of NCCL; `complete` decides if work finishes."""

    instances: list[FakeNCCL] = []
    complete = True

    class Options:
        def __init__(self):
            self.is_high_priority_stream = True
            self._timeout = timedelta(minutes=10)

    def __init__(self, store, rank: int, world_size: int, options: FakeNCCL.Options):
        self.store, self.rank, self.world_size, self.options = store, rank, world_size, options
        self.connected: torch.device | None = None
        self.aborted = False
        self.works: list[FakeWork] = []
        FakeNCCL.instances.append(self)

    def eager_connect_single_device(self, device: torch.device) -> None:
        self.connected = device

    def broadcast(self, tensors, opts) -> FakeWork:
        self.works.append(FakeWork(FakeNCCL.complete))
        return self.works[-1]

    def abort(self) -> None:
        self.aborted = True


def install(monkeypatch: pytest.MonkeyPatch) -> type[FakeNCCL]:
    """CUDA present with current device 0, and NCCL process groups that are FakeNCCL."""
    FakeNCCL.instances = []
    FakeNCCL.complete = True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    return FakeNCCL
