"""weight_sync/group.py's NCCL branches with torch.distributed mocked at the call level."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from nccl_fakes import FakeNCCL, install

from hotswap.weight_sync import group as ws_group


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> type[FakeNCCL]:
    return install(monkeypatch)

def join(device=None, timeout_s: float = 5.0, name: str = "g"):
    return ws_group.init_process_group("127.0.0.1", ws_group.free_port(), 0, 1, name,
                                       backend="auto", timeout_s=timeout_s, device=device)


def test_auto_is_nccl_for_cuda_tensors_and_gloo_for_cpu_ones(fake_nccl):
    assert ws_group.resolve_backend("auto") == "nccl"
    assert ws_group.resolve_backend("auto", "cuda:1") == "nccl"
    assert ws_group.resolve_backend("auto", "cpu") == "gloo"


def test_nccl_group_connects_eagerly_on_the_engines_device(fake_nccl):
    """An engine on cuda:1 joins from a thread whose current device is 0."""
    group = join(device=torch.device("cuda", 1), timeout_s=7.0)
    try:
        (pg,) = fake_nccl.instances
        assert group.backend == "nccl" and group.device == torch.device("cuda", 1)
        assert pg.connected == torch.device("cuda", 1)
        assert pg.options.is_high_priority_stream is False
        # NCCL's watchdog fires after our own timeout, so our error comes first
        assert pg.options._timeout == timedelta(seconds=7.0 + ws_group._NCCL_WATCHDOG_SLACK_S)
    finally:
        group.destroy()


def test_nccl_group_without_an_index_uses_the_current_device(fake_nccl):
    group = join(device="cuda")
    try:
        assert group.device == torch.device("cuda", 0)
        assert fake_nccl.instances[0].connected == torch.device("cuda", 0)
    finally:
        group.destroy()


def test_broadcast_polls_then_waits(fake_nccl):
    group = join()
    try:
        group.broadcast(torch.ones(4))
        (work,) = fake_nccl.instances[0].works
        assert work.waited
    finally:
        group.destroy()


def test_a_silent_peer_times_out_aborts_and_unregisters(fake_nccl):
    group = join(timeout_s=0.05, name="silent")
    fake_nccl.complete = False
    with pytest.raises(ws_group.WeightSyncError, match="timed out"):
        group.broadcast(torch.ones(4))
    assert fake_nccl.instances[0].aborted and not group.alive
    with pytest.raises(KeyError):
        ws_group.get_group("silent")


def test_destroy_aborts_the_nccl_communicator(fake_nccl):
    group = join()
    assert ws_group.destroy_group("g")
    assert fake_nccl.instances[0].aborted and not group.alive
