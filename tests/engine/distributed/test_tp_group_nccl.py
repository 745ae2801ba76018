"""TPGroup's NCCL branch with torch.distributed mocked at the call level."""

from __future__ import annotations

import pytest
import torch
from nccl_fakes import FakeNCCL, install

from hotswap.engine.distributed.tp_group import IDLE_TIMEOUT, TPGroup
from hotswap.weight_sync.group import free_port


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> type[FakeNCCL]:
    return install(monkeypatch)

def test_nccl_tp_group_lives_on_the_current_cuda_device(fake_nccl):
    group = TPGroup(free_port(), 0, 1, backend="nccl")
    (pg,) = fake_nccl.instances
    assert (pg.rank, pg.world_size) == (0, 1)
    assert pg.options._timeout == IDLE_TIMEOUT  # workers idle as long as the engine does
    assert group.device == torch.device("cuda", 0)
