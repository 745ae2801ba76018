"""Host KV pool: the tier beneath the device KV pool (HiCache), and the copies between them.

Same slot layout as KVPool (one [slots, kv_heads, head_dim] buffer per layer for K and for V,
page 0 reserved), in host memory: pinned on CUDA so copies can run on a side stream. On a CPU
engine both tiers live in RAM; the host tier is then a second, larger pool whose pages are
copied back (a memcpy) instead of recomputed (a prefill).

Copies: `backup` (device -> host) runs when the radix cache evicts a device page, before the
device slots are freed, so it completes synchronously. `load` (host -> device) on CUDA is issued
on a copy stream and the compute stream is made to wait on its event, so the copy overlaps the
scheduling work that follows it and the next forward reads whole pages; on CPU it runs inline.
"""

from __future__ import annotations

import torch

from hotswap.engine.kvcache.memory import KVPool, TokenToKVPoolAllocator


class HostKVPool:
    def __init__(self, num_tokens: int, device_pool: KVPool):
        page_size = device_pool.page_size
        num_pages = num_tokens // page_size
        if num_pages < 1:
            raise ValueError(f"hicache_host_tokens={num_tokens} is smaller than one page "
                             f"({page_size} tokens)")
        self.device_pool = device_pool
        self.page_size = page_size
        self.allocator = TokenToKVPoolAllocator(num_pages, page_size)
        self._pin = device_pool.device.type == "cuda"
        shape = ((num_pages + 1) * page_size, device_pool.num_kv_heads, device_pool.head_dim)
        self.k_buffers = [self._empty(shape) for _ in range(device_pool.num_layers)]
        self.v_buffers = [self._empty(shape) for _ in range(device_pool.num_layers)]
        self._stream = torch.cuda.Stream(device_pool.device) if self._pin else None

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=self.device_pool.dtype, pin_memory=self._pin)

    @property
    def size(self) -> int:
        return self.allocator.size

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy the device pool's KV at `device_slots` into this pool at `host_slots`."""
        dev = self.device_pool
        idx = device_slots.to(dev.device)
        for src, dst in zip(dev.k_buffers + dev.v_buffers, self.k_buffers + self.v_buffers):
            dst.index_copy_(0, host_slots, src.index_select(0, idx).cpu())

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy this pool's KV at `host_slots` into the device pool at `device_slots`."""
        self.write_device(self.read(host_slots), device_slots)

    def write_device(self, kv: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Write `kv` ([2 * layers, n, kv_heads, head_dim], host memory) into the device pool."""
        dev = self.device_pool
        dsts = dev.k_buffers + dev.v_buffers
        if self._stream is None:
            for i, dst in enumerate(dsts):
                dst.index_copy_(0, device_slots, kv[i])
            return
        # The compute stream may still be reading or writing these slots: wait for it first.
        self._stream.wait_stream(torch.cuda.current_stream(dev.device))
        with torch.cuda.stream(self._stream):
            idx = device_slots.to(dev.device, non_blocking=True)
            staged = kv.pin_memory().to(dev.device, non_blocking=True)
            for i, dst in enumerate(dsts):
                dst.index_copy_(0, idx, staged[i])
            done = torch.cuda.Event()
            done.record(self._stream)
        # A GPU-side dependency: the host thread goes on scheduling while the copy runs, and
        # the next forward (or backup) on the compute stream starts only after it lands.
        torch.cuda.current_stream(dev.device).wait_event(done)

    def read(self, host_slots: torch.Tensor) -> torch.Tensor:
        """KV at `host_slots` as one [2 * layers, n, kv_heads, head_dim] tensor (for storage)."""
        return torch.stack([b.index_select(0, host_slots)
                            for b in self.k_buffers + self.v_buffers])
