"""Request-level KV bookkeeping over the allocator, the req-to-token table and the radix cache.

A running Req's `kv_slots` hold the slot of every token whose KV is computed. The first
`tree_prefix_len` of them are borrowed: from the radix tree, pinned by a lock on `last_node`, and,
until the end of the step that admitted the request, possibly from a peer admitted in the same
step (see `admit`). The rest belong to the request and are freed (or handed to the tree) when it
leaves. Pages never mix owners: `tree_prefix_len` is always a multiple of page_size.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import Any

import torch

from hotswap.engine.core.forward_batch import flat_ranges
from hotswap.engine.core.namespace import Namespace
from hotswap.engine.core.request import Req
from hotswap.engine.kvcache.handoff import Exported, HandoffRefused
from hotswap.engine.kvcache.memory import ReqToTokenPool, TokenToKVPoolAllocator
from hotswap.engine.kvcache.radix_cache import RadixCache


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Binary search with slice comparisons: O(n log n) in C rather than a Python loop."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class StepPeers:
    """The requests given slots for one step's forward (KVManager.admit's peers): per namespace,
    the tokens each computes, in sorted order. The longest common prefix of a token list with
    any of them is that with one of its two neighbours in this order, so a request finds its
    best peer in two comparisons instead of one with every peer (~5 us each; admissions per
    step grew with the square of the requests admitted together)."""

    def __init__(self) -> None:
        self._keys: dict[Namespace, list[list[int]]] = {}
        self._reqs: dict[Namespace, list[Req]] = {}

    def add(self, req: Req) -> None:
        """`req` has its slots for the step (its kv_len is final)."""
        key = req.cache_ids[: req.kv_len]
        keys = self._keys.setdefault(req.namespace, [])
        i = bisect.bisect_right(keys, key)
        keys.insert(i, key)
        self._reqs.setdefault(req.namespace, []).insert(i, req)

    def neighbours(self, ns: Namespace, ids: list[int]) -> list[tuple[Req, list[int]]]:
        """The (at most two) peers whose tokens sort next to `ids`, with those tokens."""
        keys = self._keys.get(ns, [])
        i = bisect.bisect_left(keys, ids)
        lo = max(i - 1, 0)
        return list(zip(self._reqs[ns][lo: i + 1], keys[lo: i + 1])) if keys else []


class KVManager:
    def __init__(self, allocator: TokenToKVPoolAllocator, req_to_token: ReqToTokenPool,
                 tree: RadixCache, page_size: int):
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.tree = tree
        self.page_size = page_size

    def available(self) -> int:
        """Tokens that can be allocated now, evicting unlocked tree nodes if needed."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def match_len(self, ns: Namespace, req: Req) -> int:
        return self._outside_images(req, self.tree.cached_len(ns, self._matchable(req)))

    def _matchable(self, req: Req, ns: Namespace | None = None) -> list[int]:
        """The keys of what `req` may take from the cache. At least one token is always
        recomputed: its logits sample the next token (or give a classify request its scores).
        Per-token scores need every position computed. With `ns`, keys are cut where the
        cache's match under `ns` would end inside an image's run."""
        if req.scoring is not None and req.scoring.per_token:
            return []
        ids = req.cache_ids
        ids = ids[: len(ids) - 1]
        if req.images is not None and ns is not None:
            cached = self.tree.cached_len(ns, ids)
            ids = ids[: self._outside_images(req, cached)] if cached else ids
        return ids

    def _outside_images(self, req: Req, n: int) -> int:
        """The longest page-aligned prefix of at most n tokens that ends outside every image's
        run (a match never ends inside an image: docs/api.md#images)."""
        if req.images is None:
            return n
        while (cut := req.images.match_end(n)) != n:
            n = cut - cut % self.page_size
        return n

    def admit(self, req: Req, ns: Namespace, peers: StepPeers | None = None) -> bool:
        """Give `req` a table row and its cached prefix; False when no row is free.

        `peers` holds requests already given slots for this step's forward. Past the tree's match,
        `req` also borrows the longest run of whole pages a peer is computing for the same tokens:
        both rows run in one forward, whose backends store each layer's new K/V before any row
        attends, so the peer's KV is there when `req` reads it. The step's `cache_unfinished`
        then hands those pages to the tree, where both requests find them; so peers are
        passed only while the cache is enabled.
        """
        row = self.req_to_token.alloc()
        if row is None:
            return False
        ids = self._matchable(req, ns)
        match = self.tree.match_prefix(ns, ids)
        self.tree.inc_lock_ref(match.last_node)
        self.unpin_handoff(req)  # the request's own lock holds the handed-off prefix now
        loaded = self.tree.fetch_lower_tiers(ns, ids, match)  # HiCache: host / storage KV
        match = loaded.match
        req.namespace, req.req_pool_idx, req.last_node = ns, row, match.last_node
        req.kv_slots = torch.cat((match.slots, self._peer_slots(req, ids, ns,
                                                                match.slots.numel(), peers)))
        req.tree_prefix_len = req.kv_len
        if req.kv_len >= req.cached_tokens:
            req.cached_from_host = loaded.host_tokens
            req.cached_from_storage = loaded.storage_tokens
        req.cached_tokens = max(req.cached_tokens, req.kv_len)
        self.req_to_token.write(row, 0, req.kv_slots)
        return True

    def _peer_slots(self, req: Req, ids: list[int], ns: Namespace, start: int,
                    peers: StepPeers | None) -> torch.Tensor:
        """A peer's slots for ids[start:end], the longest page-aligned such run.

        Past `start` (the tree's match for `req`) a peer's slots are never the tree's: the tree
        would have matched them for `req` too. They are the peer's own or another peer's.
        """
        best, end = None, start
        if peers is not None and len(ids) - start >= self.page_size:
            for peer, tokens in peers.neighbours(ns, ids):
                shared = common_prefix_len(ids, tokens)
                shared -= shared % self.page_size
                if shared > end:
                    best, end = peer, shared
        end = self._outside_images(req, end)
        if best is None or end <= start:
            return torch.empty(0, dtype=torch.int64)
        return best.kv_slots[start:end]

    def import_prefix(self, req: Req, ns: Namespace, tokens: list[int], write: Callable[
            [torch.Tensor], None]) -> int:
        """Put handed-off KV for `tokens` into the tree under `ns` (`write(slots)` fills the
        new slots) and pin it for `req` until `admit` (or `unpin_handoff`); returns the tokens
        the tree holds for them now. Raises HandoffRefused when no pages are free."""
        if self.tree.disable:
            raise HandoffRefused("this engine's prefix cache is disabled")
        n = len(tokens)
        short = n + self.page_size - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        slots = self.allocator.alloc(n)
        if slots is None:
            raise HandoffRefused(f"no room for {n} tokens in the KV pool")
        write(slots)
        taken_from = self.tree.insert(ns, tokens, slots)
        aligned = n - n % self.page_size
        self.allocator.free(torch.cat((slots[:taken_from], slots[aligned:])))
        match = self.tree.match_prefix(ns, tokens)
        self.tree.inc_lock_ref(match.last_node)
        req.handoff_lock = match.last_node
        return match.slots.numel()

    def export_prompt(self, req: Req, pool: Any) -> None:
        """A prefill engine's request hands its prompt's KV on (engine/kvcache/handoff.py):
        read out of `pool` into req.kv_export."""
        slots = req.kv_slots[: len(req.prompt_ids)]
        if slots.numel() < len(req.prompt_ids):
            return
        start = time.perf_counter()
        routes = pool.read_routes(slots) if pool.routes is not None else None
        kv = pool.read_tokens(slots)
        req.kv_export = Exported(req.namespace, list(req.prompt_ids), self.page_size, kv,
                                 routes, time.perf_counter() - start,
                                 [] if req.images is None else req.images.hashes)

    def unpin_handoff(self, req: Req) -> None:
        if req.handoff_lock is not None:
            self.tree.dec_lock_ref(req.handoff_lock)
            req.handoff_lock = None

    def fork(self, req: Req, leader: Req) -> bool:
        """Start `req` on the KV of `leader`'s prompt, which the tree must hold whole.

        False (nothing taken) when no table row is free or part of the prompt is not yet in
        the tree (an unaligned tail page is never shared).
        """
        prompt = len(leader.prompt_ids)
        if leader.tree_prefix_len < prompt or leader.req_pool_idx is None:
            return False
        row = self.req_to_token.alloc()
        if row is None:
            return False
        self.tree.inc_lock_ref(leader.last_node)
        req.namespace, req.req_pool_idx, req.last_node = leader.namespace, row, leader.last_node
        req.kv_slots = leader.kv_slots[:prompt].clone()
        req.tree_prefix_len = req.cached_tokens = prompt
        self.req_to_token.write(row, 0, req.kv_slots)
        return True

    def alloc(self, reqs: list[Req], lens: list[int]) -> torch.Tensor | None:
        """Slots for `lens[i]` new tokens of each req (evicting if short); None if impossible."""
        need = sum(lens) + self.page_size * len(reqs)
        if self.allocator.available_size() < need:
            self.tree.evict(need - self.allocator.available_size())
        starts = [r.kv_len for r in reqs]
        last = ([int(r.kv_slots[-1]) if r.kv_len else -1 for r in reqs] if self.page_size > 1
                else [-1] * len(reqs))  # only a partly used last page needs it
        slots = self.allocator.alloc_extend(starts, last, lens)
        if slots is None:
            return None
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        cols = torch.tensor(starts, dtype=torch.int64)
        if any(n != 1 for n in lens):  # not a decode step: each row's run of cells
            counts = torch.tensor(lens, dtype=torch.int64)
            rows, cols = torch.repeat_interleave(rows, counts), flat_ranges(cols, counts)
        self.req_to_token.write_cells(rows, cols, slots)
        for req, part in zip(reqs, slots.split(lens)):
            req.kv_slots = torch.cat((req.kv_slots, part))
        return slots

    def truncate(self, req: Req, length: int) -> None:
        """Keep `req`'s KV of its first `length` tokens only (a verify step's rejected drafts
        go): the pages that held nothing else go back to the pool."""
        dropped = req.kv_slots[length:]
        if dropped.numel() == 0:
            return
        req.kv_slots = req.kv_slots[:length]
        ps = self.page_size
        if ps > 1 and length % ps:  # the kept tokens' last page stays
            dropped = dropped[dropped // ps != int(req.kv_slots[-1]) // ps]
        self.allocator.free(dropped)

    def cache_unfinished(self, req: Req) -> None:
        """Hand the computed, page-aligned tokens to the tree so other requests can match them.

        A no-op when the cache is disabled or the request's namespace was retired (its KV was
        computed by older weights)."""
        match = self.tree.cache_unfinished(req.namespace, req.cache_ids[:req.kv_len],
                                           req.kv_slots, req.last_node)
        if match.last_node is req.last_node:  # nothing new reached the tree
            return
        taken = match.slots.numel()
        req.last_node = match.last_node
        req.kv_slots = torch.cat((match.slots, req.kv_slots[taken:]))
        req.tree_prefix_len = taken
        self.req_to_token.write(req.req_pool_idx, 0, match.slots)

    def release(self, req: Req, cache: bool = True) -> None:
        """Free everything `req` holds. Its computed KV goes to the tree while still valid,
        unless `cache` is False: its slots may not hold what they should (a failed forward, or
        an admission undone before its step ran)."""
        if req.req_pool_idx is None:
            return
        if cache:
            self.cache_unfinished(req)
            self.tree.write_through(req.last_node)  # still locked by req
        self.allocator.free(req.kv_slots[req.tree_prefix_len:])
        self.tree.dec_lock_ref(req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.namespace = None, None, None
        req.kv_slots = req.kv_slots[:0]
        req.tree_prefix_len = 0

    def held_by_requests(self, reqs: list[Req]) -> int:
        """Slots owned by requests (not the tree), counted in whole pages."""
        ps = self.page_size
        return sum(-(-(r.kv_len - r.tree_prefix_len) // ps) * ps for r in reqs
                   if r.req_pool_idx is not None)

    def check_integrity(self, reqs: list[Req]) -> None:
        self.tree.check_integrity(self.held_by_requests(reqs))
