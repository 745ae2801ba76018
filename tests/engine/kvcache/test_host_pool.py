"""HostKVPool: KV copied device -> host -> device comes back bit-identical, on CPU and CUDA."""

from __future__ import annotations

import pytest
import torch

from hotswap.engine.kvcache.host_pool import HostKVPool
from hotswap.engine.kvcache.memory import KVPool

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_backup_then_load_round_trips(device):
    pool = KVPool(num_pages=8, page_size=2, num_layers=3, num_kv_heads=2, head_dim=4,
                  dtype=torch.float32, device=device)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, device=device))
    host = HostKVPool(12, pool)
    src = torch.tensor([2, 3, 4, 5])
    host_slots = host.allocator.alloc(4)
    host.backup(src, host_slots)
    dst = torch.tensor([12, 13, 14, 15])
    host.load(host_slots, dst)
    for buf in pool.k_buffers + pool.v_buffers:
        assert torch.equal(buf[dst.to(device)].cpu(), buf[src.to(device)].cpu())
    stored = host.read(host_slots)  # what the storage tier writes: [2 * layers, n, heads, dim]
    assert stored.shape == (6, 4, 2, 4)
    assert torch.equal(stored[0], pool.k_buffers[0][src.to(device)].cpu())


def test_host_tier_smaller_than_a_page_is_refused():
    pool = KVPool(num_pages=4, page_size=4, num_layers=1, num_kv_heads=1, head_dim=4,
                  dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="hicache_host_tokens"):
        HostKVPool(3, pool)
