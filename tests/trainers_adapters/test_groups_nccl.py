"""trainers_adapters/groups.py's NCCL branches (OpenRLHF's and verl's helpers), CUDA mocked."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from nccl_fakes import FakeNCCL, install
from torch.distributed.distributed_c10d import _world

from hotswap.trainers_adapters import groups
from hotswap.weight_sync.group import free_port


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> type[FakeNCCL]:
    return install(monkeypatch)

def test_openrlhf_device_index_is_where_nccl_connects(fake_nccl):
    """OpenRLHF passes torch.cuda.current_device() of its own process, e.g. 1."""
    comm = groups.stateless_init_process_group("127.0.0.1", free_port(), 0, 1, device=1)
    try:
        assert comm.group.backend == "nccl"
        assert comm.device == torch.device("cuda", 1)
        assert fake_nccl.instances[0].connected == torch.device("cuda", 1)
    finally:
        groups.destroy_process_group(comm)
    assert fake_nccl.instances[0].aborted


def test_verl_custom_group_registers_and_destroys(fake_nccl):
    pg = groups.init_custom_process_group(
        backend="nccl", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0,
        group_name="verl", timeout=timedelta(seconds=30))
    (fake,) = fake_nccl.instances
    assert pg is fake and _world.pg_group_ranks[pg] == {0: 0}
    groups.destroy_process_group(pg)
    assert fake.aborted and pg not in _world.pg_group_ranks


class CudaTensor:
    """What HotswapCommunicator.broadcast reads of a CUDA tensor, without CUDA."""

    is_cuda = True
    device = torch.device("cuda", 1)

    def contiguous(self):
        return self


def test_openrlhf_stream_is_synchronized_before_the_broadcast(fake_nccl, monkeypatch):
    comm = groups.stateless_init_process_group("127.0.0.1", free_port(), 0, 1, device=1)
    order = []

    class Stream:
        def synchronize(self):
            order.append("stream synchronized")

    monkeypatch.setattr(comm.group, "broadcast", lambda t, src: order.append("broadcast"))
    try:
        comm.broadcast(CudaTensor(), src=0, stream=Stream())
    finally:
        groups.destroy_process_group(comm)
    assert order == ["stream synchronized", "broadcast"]
