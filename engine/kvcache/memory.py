"""KV memory: the per-layer KV pool, its page allocator and the request-to-token table.

Slot layout: slot = page * page_size + offset. Page 0 is reserved and kept zero: padded attention
reads point at it, so it must never hold NaN/Inf garbage. Usable pages are 1..num_pages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class KVPool:
    """K and V buffers for every layer, indexed by token slot; with `route_shape` (MoE layers,
    top_k) also each slot's routing: the experts its token went to in every MoE layer, kept
    with the KV so that a cached prefix reports the routing that computed it."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 route_shape: tuple[int, int] | None = None,
                 empty: Callable[..., torch.Tensor] = torch.empty):
        self.route_shape = route_shape
        self.empty = empty  # empty(shape, dtype=, device=): each layer's K or V buffer
        self.routes: torch.Tensor | None = None  # [slots, moe_layers, top_k] int16
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.k_buffers: list[torch.Tensor] = []
        self.v_buffers: list[torch.Tensor] = []
        self.allocate()

    @property
    def num_slots(self) -> int:
        return (self.num_pages + 1) * self.page_size

    def allocate(self) -> None:
        shape = (self.num_slots, self.num_kv_heads, self.head_dim)
        # empty, not zeros: untouched pages of a large CPU pool stay non-resident.
        self.k_buffers = [self.empty(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.num_layers)]
        self.v_buffers = [self.empty(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.num_layers)]
        for buf in self.k_buffers + self.v_buffers:
            buf[: self.page_size].zero_()
        if self.route_shape is not None:
            self.routes = torch.full((self.num_slots, *self.route_shape), -1, dtype=torch.int16,
                                     device=self.device)

    def release(self) -> None:
        self.k_buffers, self.v_buffers, self.routes = [], [], None

    @property
    def allocated(self) -> bool:
        return bool(self.k_buffers)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = (-1, self.num_kv_heads, self.head_dim)
        self.k_buffers[layer_id].index_copy_(0, loc, k.reshape(shape))
        self.v_buffers[layer_id].index_copy_(0, loc, v.reshape(shape))

    def read_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV at `slots` as one [2 * layers, n, kv_heads, head_dim] CPU tensor (K of every
        layer, then V)."""
        buffers = self.k_buffers + self.v_buffers
        n = slots.numel()
        out = torch.empty((len(buffers), n, self.num_kv_heads, self.head_dim), dtype=self.dtype,
                          device=self.device)
        lo = _run_start(slots)
        idx = slots.to(self.device)
        for dst, src in zip(out, buffers):
            if lo is None:
                torch.index_select(src, 0, idx, out=dst)
            else:
                dst.copy_(src[lo: lo + n])
        return out.cpu()

    def write_tokens(self, kv: torch.Tensor, slots: torch.Tensor,
                     routes: torch.Tensor | None = None) -> None:
        """Write `kv` (read_tokens' layout) and, where kept, `routes` at `slots`."""
        idx = slots.to(self.device)
        lo = _run_start(slots)
        for src, dst in zip(kv.to(self.device), self.k_buffers + self.v_buffers):
            if lo is None:
                dst.index_copy_(0, idx, src)
            else:
                dst[lo: lo + slots.numel()].copy_(src)
        if self.routes is not None:
            if routes is None:
                self.routes.index_fill_(0, idx, -1)
            else:
                self.routes.index_copy_(0, idx, routes.to(self.device))

    def read_routes(self, slots: torch.Tensor) -> torch.Tensor:
        """The routing kept at `slots`: [len(slots), moe_layers, top_k] int16, on the CPU."""
        assert self.routes is not None
        return self.routes.index_select(0, slots.to(self.device)).cpu()


def _run_start(slots: torch.Tensor) -> int | None:
    """The first slot when `slots` are one consecutive run (a fresh prompt's pages: copied as
    a slice, at memcpy speed), else None."""
    n = slots.numel()
    if n == 0:
        return None
    lo = int(slots[0])
    return lo if int(slots[-1]) - lo == n - 1 and bool((slots.diff() == 1).all()) else None


class TokenToKVPoolAllocator:
    """Hands out KV slots page by page; a request's tokens fill its pages contiguously."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.free_pages: list[int] = []
        self.clear()

    @property
    def size(self) -> int:
        """Usable token slots in the pool."""
        return self.num_pages * self.page_size

    def clear(self) -> None:
        # Popped from the end: low page numbers are handed out first.
        self.free_pages = list(range(self.num_pages, 0, -1))

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` tokens that start on a fresh page."""
        return self.alloc_extend([0], [-1], [num_tokens])

    def alloc_extend(self, prefix_lens: list[int], last_locs: list[int],
                     extend_lens: list[int]) -> torch.Tensor | None:
        """Slots for each row's new tokens, filling the row's partly used last page first.

        `last_locs[i]` is the slot of row i's last existing token (ignored when the prefix ends on
        a page boundary). Returns None, allocating nothing, when the pool is short.
        """
        ps = self.page_size
        if ps == 1:
            total = sum(extend_lens)
            if total > len(self.free_pages):
                return None
            pages = self.free_pages[len(self.free_pages) - total:]
            del self.free_pages[len(self.free_pages) - total:]
            return torch.tensor(pages[::-1], dtype=torch.int64)
        need = [self._new_pages(p, e) for p, e in zip(prefix_lens, extend_lens)]
        if sum(need) > len(self.free_pages):
            return None
        out: list[int] = []
        for prefix, last, ext in zip(prefix_lens, last_locs, extend_lens):
            room = (-prefix) % ps
            take = min(room, ext)
            out.extend(range(last + 1, last + 1 + take))
            remaining = ext - take
            while remaining > 0:
                page = self.free_pages.pop()
                n = min(ps, remaining)
                out.extend(range(page * ps, page * ps + n))
                remaining -= n
        return torch.tensor(out, dtype=torch.int64)

    def _new_pages(self, prefix_len: int, extend_len: int) -> int:
        room = (-prefix_len) % self.page_size
        return -(-max(0, extend_len - room) // self.page_size)

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages of `slots`; the caller owns every token on those pages."""
        if slots.numel() == 0:
            return
        if self.page_size == 1:
            self.free_pages.extend(slots.tolist())
        else:
            self.free_pages.extend(torch.unique(slots // self.page_size).tolist())


class ReqToTokenPool:
    """Maps (request row, position) to the KV slot holding that token."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str):
        self.max_reqs = max_reqs
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int64,
                                        device=device)
        self.free_rows = list(range(max_reqs - 1, -1, -1))

    def available_size(self) -> int:
        return len(self.free_rows)

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int) -> None:
        self.free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start: start + slots.numel()] = slots.to(self.req_to_token.device)

    def write_cells(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[i], cols[i]] = slots[i] for every i, in one op."""
        device = self.req_to_token.device
        self.req_to_token[rows.to(device), cols.to(device)] = slots.to(device)
