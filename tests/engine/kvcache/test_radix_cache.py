"""Radix cache tests: the scheduler's ownership protocol played against a real page allocator.

`Sim` stands in for the scheduler and for the KV pool: every slot a request computes records which
(namespace, prefix) it holds, so any match that hands out a stale or foreign slot is caught.
Conservation (DESIGN invariant 2) is checked after every step.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest
import torch

from hotswap.engine.core.namespace import Namespace
from hotswap.engine.kvcache.memory import TokenToKVPoolAllocator
from hotswap.engine.kvcache.radix_cache import RadixCache, TreeNode

V1 = Namespace("v1")


@dataclass(eq=False)  # requests compare by identity
class Req:
    ns: Namespace
    tokens: list[int]
    slots: torch.Tensor
    node: TreeNode
    borrowed: int  # leading slots owned by the tree (locked through `node`)
    cached: int = field(default=0)


class Sim:
    def __init__(self, num_pages: int, page_size: int, disable: bool = False):
        self.ps = page_size
        self.alloc = TokenToKVPoolAllocator(num_pages, page_size)
        self.cache = RadixCache(self.alloc, page_size, disable=disable)
        self.kv: dict[int, tuple] = {}
        self.running: list[Req] = []

    def held(self) -> int:
        ps = self.ps
        return sum(-(-(len(r.slots) - r.borrowed) // ps) * ps for r in self.running)

    def check(self) -> None:
        self.cache.check_integrity(self.held())

    def verify(self, ns: Namespace, tokens: list[int], slots: torch.Tensor) -> None:
        for i, slot in enumerate(slots.tolist()):
            assert self.kv.get(slot) == (ns, tuple(tokens[: i + 1])), f"stale KV at position {i}"

    def _alloc(self, prefix: int, last: int, n: int) -> torch.Tensor | None:
        out = self.alloc.alloc_extend([prefix], [last], [n])
        if out is None:
            self.cache.evict(n + self.ps)
            out = self.alloc.alloc_extend([prefix], [last], [n])
        return out

    def _write(self, req: Req, start: int) -> None:
        for i in range(start, len(req.tokens)):
            self.kv[int(req.slots[i])] = (req.ns, tuple(req.tokens[: i + 1]))

    def admit(self, ns: Namespace, tokens: list[int]) -> Req | None:
        match = self.cache.match_prefix(ns, tokens)
        self.cache.inc_lock_ref(match.last_node)
        p = len(match.slots)
        assert p % self.ps == 0
        self.verify(ns, tokens, match.slots)
        own = self._alloc(p, int(match.slots[-1]) if p else -1, len(tokens) - p)
        if own is None:
            self.cache.dec_lock_ref(match.last_node)
            return None
        req = Req(ns, list(tokens), torch.cat([match.slots, own]), match.last_node, p, cached=p)
        self._write(req, p)
        self.running.append(req)
        return req

    def extend(self, req: Req, new_tokens: list[int]) -> bool:
        n = len(req.tokens)
        own = self._alloc(n, int(req.slots[-1]), len(new_tokens))
        if own is None:
            return False
        req.tokens += new_tokens
        req.slots = torch.cat([req.slots, own])
        self._write(req, n)
        return True

    def chunk(self, req: Req) -> None:
        match = self.cache.cache_unfinished(req.ns, req.tokens, req.slots, req.node)
        k = len(match.slots)
        self.verify(req.ns, req.tokens, match.slots)
        req.slots[:k] = match.slots
        req.node, req.borrowed = match.last_node, k

    def finish(self, req: Req) -> None:
        """As KVManager.release: hand the KV to the tree, free the own tail, drop the lock."""
        self.running.remove(req)
        self.chunk(req)
        self.alloc.free(req.slots[req.borrowed:])
        self.cache.dec_lock_ref(req.node)

    def protected(self) -> int:
        return self.cache.total_size() - self.cache.evictable_size()


def tokens_of(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture(params=[1, 4], ids=["page1", "page4"])
def ps(request) -> int:
    return request.param


def test_namespace_is_structured_and_frozen():
    assert Namespace("v1|lora") != Namespace("v1", "lora")
    assert Namespace("v1", cache_salt="a") != Namespace("v1", "a")
    assert len({Namespace("v1", "a", 2), Namespace("v1", "a", 2)}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        V1.weight_version = "v2"  # type: ignore[misc]


OTHERS = [Namespace("v2"), Namespace("v1", "lora"), Namespace("v1", adapter_version=1),
          Namespace("v1", None, 0, "s")]


@pytest.mark.parametrize("other", OTHERS)
def test_same_tokens_other_namespace_share_nothing(ps, other):
    sim = Sim(64 // ps, ps)
    ids = tokens_of(13)
    sim.finish(sim.admit(V1, ids))
    sim.check()
    req = sim.admit(other, ids)
    assert req.cached == 0
    sim.check()
    sim.finish(req)
    again = sim.admit(V1, ids)
    assert again.cached == 13 - 13 % ps
    sim.finish(again)
    sim.check()


def test_match_splits_inside_an_edge(ps):
    sim = Sim(64, ps)
    a = tokens_of(16)
    sim.finish(sim.admit(V1, a))
    b = a[:6] + [100, 101, 102, 103, 104, 105]
    req = sim.admit(V1, b)
    shared = 6 - 6 % ps
    assert req.cached == shared
    root = sim.cache._roots[V1]
    (top,) = root.children.values()
    assert len(top.key) == shared and len(top.children) == 1
    assert len(next(iter(top.children.values())).key) == 16 - shared
    sim.check()
    sim.finish(req)
    sim.check()
    assert len(top.children) == 2
    assert sim.cache.total_size() == 16 + 12 - shared
    assert len(sim.cache.match_prefix(V1, b).slots) == 12


def test_match_rounds_down_to_pages():
    sim = Sim(16, 4)
    sim.finish(sim.admit(V1, tokens_of(11)))  # the 3-token tail page is freed, not cached
    assert sim.cache.total_size() == 8
    assert len(sim.cache.match_prefix(V1, tokens_of(7)).slots) == 4
    assert len(sim.cache.match_prefix(V1, tokens_of(3)).slots) == 0
    sim.check()


def test_duplicate_prefill_is_freed_on_insert(ps):
    sim = Sim(64, ps)
    ids = tokens_of(16)
    first, second = sim.admit(V1, ids), sim.admit(V1, ids)
    assert second.cached == 0
    sim.finish(first)
    sim.check()
    assert sim.cache.insert(V1, ids, second.slots) == 16  # the tree already has every token
    sim.finish(second)  # so all of second's slots are duplicates and go back to the pool
    sim.check()
    assert sim.alloc.available_size() == sim.alloc.size - 16


def test_tree_keeps_its_own_copy_of_slots(ps):
    sim = Sim(16, ps)
    req = sim.admit(V1, tokens_of(8))
    kept = req.slots.clone()
    sim.finish(req)
    req.slots.fill_(0)  # the caller's row in req_to_token gets reused by the next request
    assert torch.equal(sim.cache.match_prefix(V1, tokens_of(8)).slots, kept)
    sim.check()


def test_eviction_is_lru_over_leaves(ps):
    sim = Sim(64, ps)
    a, b, c = tokens_of(8, 0), tokens_of(8, 100), tokens_of(8, 200)
    for ids in (a, b, c):
        sim.finish(sim.admit(V1, ids))
    sim.cache.match_prefix(V1, a)  # a is now the most recently used
    assert sim.cache.evict(1) == 8
    assert len(sim.cache.match_prefix(V1, b).slots) == 0
    assert sim.cache.evict(1) == 8  # c was used before a
    assert len(sim.cache.match_prefix(V1, c).slots) == 0
    assert len(sim.cache.match_prefix(V1, a).slots) == 8
    sim.check()


def test_parent_becomes_evictable_after_its_children(ps):
    sim = Sim(64, ps)
    sim.finish(sim.admit(V1, tokens_of(8)))
    sim.finish(sim.admit(V1, tokens_of(8) + tokens_of(8, 50)))
    assert sim.cache.evict(1) == 8  # the leaf goes, its parent stays
    assert len(sim.cache.match_prefix(V1, tokens_of(8) + tokens_of(8, 50)).slots) == 8
    assert sim.cache.evict(100) == 8
    assert sim.cache.total_size() == 0
    sim.check()


def test_locked_nodes_are_never_evicted(ps):
    sim = Sim(32, ps)
    sim.finish(sim.admit(V1, tokens_of(8, 300)))
    sim.finish(sim.admit(V1, tokens_of(12)))
    req = sim.admit(V1, tokens_of(8) + [900, 901, 902, 903])  # locks the first 8 of tokens_of(12)
    assert sim.protected() == 8
    sim.cache.evict(10**6)
    assert sim.protected() == 8 and sim.cache.evictable_size() == 0
    sim.verify(V1, req.tokens, sim.cache.match_prefix(V1, tokens_of(8)).slots)
    sim.check()
    sim.finish(req)
    assert sim.protected() == 0
    sim.cache.evict(10**6)
    assert sim.alloc.available_size() == sim.alloc.size
    sim.check()


def test_retire_frees_unlocked_now_and_locked_on_release(ps):
    sim = Sim(64, ps)
    sim.finish(sim.admit(V1, tokens_of(8, 500)))
    sim.finish(sim.admit(V1, tokens_of(16)))
    req = sim.admit(V1, tokens_of(12) + [7, 7, 7, 7])
    assert req.cached == 12 - 12 % ps
    free_before = sim.alloc.available_size()
    sim.cache.retire_namespace(V1)
    assert len(sim.cache.match_prefix(V1, tokens_of(16)).slots) == 0
    assert sim.alloc.available_size() == free_before + 8 + 16 - req.cached
    assert sim.cache.total_size() == req.cached
    sim.check()
    assert sim.extend(req, [1, 2, 3])
    sim.chunk(req)  # a retired namespace stores nothing, not even partial progress
    assert req.borrowed == req.cached
    sim.check()
    sim.finish(req)
    assert sim.cache.total_size() == 0 and sim.alloc.available_size() == sim.alloc.size
    assert sim.cache.insert(V1, tokens_of(9), torch.arange(9)) == 9 - 9 % ps
    sim.check()


def test_retire_where_keeps_the_others(ps):
    sim = Sim(64, ps)
    v2, salted = Namespace("v2"), Namespace("v2", cache_salt="x")
    for ns in (V1, v2, salted):
        sim.finish(sim.admit(ns, tokens_of(8)))
    sim.cache.retire_where(lambda ns: ns != v2)
    assert [len(sim.cache.match_prefix(ns, tokens_of(8)).slots) for ns in (V1, v2, salted)] == [
        0, 8, 0]
    assert sim.cache.total_size() == 8
    sim.check()


def test_chunked_prefill_shares_partial_progress(ps):
    sim = Sim(64, ps)
    ids = tokens_of(22)
    req = sim.admit(V1, ids[:8])
    sim.chunk(req)
    assert req.borrowed == 8 and sim.protected() == 8
    sim.check()
    assert sim.extend(req, ids[8:18])
    sim.chunk(req)
    assert req.borrowed == 18 - 18 % ps
    sim.check()
    other = sim.admit(V1, ids)  # sees the running request's progress
    assert other.cached == req.borrowed
    assert sim.extend(req, ids[18:])
    sim.finish(req)
    sim.check()
    sim.finish(other)
    sim.check()
    assert sim.cache.total_size() == 22 - 22 % ps and sim.protected() == 0


def test_disabled_cache_returns_everything(ps):
    sim = Sim(32, ps, disable=True)
    for _ in range(2):
        req = sim.admit(V1, tokens_of(10))
        assert req.cached == 0
        sim.chunk(req)
        sim.check()
        sim.finish(req)
        sim.check()
    assert sim.cache.total_size() == 0 and sim.alloc.available_size() == sim.alloc.size


def test_check_integrity_catches_leaks_and_double_ownership():
    sim = Sim(16, 1)
    sim.admit(V1, tokens_of(4))
    sim.finish(sim.admit(V1, tokens_of(6, 50)))
    sim.check()
    with pytest.raises(AssertionError, match="requests 0 != pool"):
        sim.cache.check_integrity(0)
    tree_page = int(sim.cache.match_prefix(V1, tokens_of(6, 50)).slots[0])
    free_page = sim.alloc.free_pages.pop()
    sim.alloc.free_pages.append(tree_page)  # same count, but a tree page is now also free
    with pytest.raises(AssertionError, match="also free"):
        sim.check()
    sim.alloc.free_pages[-1] = free_page
    sim.check()
    sim.cache.inc_lock_ref(sim.cache.match_prefix(V1, tokens_of(6, 50)).last_node)
    sim.cache._protected -= 6  # a size counter that drifted from the tree
    sim.cache._evictable += 6
    with pytest.raises(AssertionError, match="evictable 0 != 6"):
        sim.check()


def test_deep_tree_needs_no_recursion():
    alloc = TokenToKVPoolAllocator(1200, 1)
    cache = RadixCache(alloc, 1)
    for n in range(1, 1101):  # a chain 1100 nodes deep: deeper than the recursion limit
        own = torch.cat([torch.zeros(n - 1, dtype=torch.int64), alloc.alloc(1)])
        assert cache.insert(V1, tokens_of(n), own) == n - 1
    cache.check_integrity()
    cache.retire_namespace(V1)
    assert alloc.available_size() == alloc.size
    cache.check_integrity()


def test_lru_heap_stays_bounded_under_repeated_hits():
    sim = Sim(64, 1)
    for start in range(0, 40, 8):
        sim.finish(sim.admit(V1, tokens_of(8, start * 10)))
    for _ in range(3000):
        sim.cache.match_prefix(V1, tokens_of(8, 0))
    assert len(sim.cache._heap) <= 4 * 5 + 65
    sim.check()
    assert sim.cache.evict(8) == 8
    assert len(sim.cache.match_prefix(V1, tokens_of(8, 0)).slots) == 8  # the hot entry stayed


@pytest.mark.parametrize("seed", range(6))
def test_fuzz_protocol_keeps_invariants(ps, seed):
    rng = random.Random(seed)
    sim = Sim(128 // ps, ps)
    spaces = [V1, Namespace("v1", cache_salt="s"), Namespace("v1", "lora", 1)]
    live = list(spaces)
    bases = [[rng.randrange(3) for _ in range(rng.randrange(8, 20))] for _ in range(3)]
    for step in range(300):
        op = rng.random()
        if not sim.running or (op < 0.3 and len(sim.running) < 6):
            ns = rng.choice(spaces[-4:])  # mostly live namespaces, sometimes a retired one
            base = rng.choice(bases)
            tail = rng.choices(range(3), k=rng.randrange(4))
            ids = base[: rng.randrange(1, len(base) + 1)] + tail
            req = sim.admit(ns, ids)
            if req is not None and ns not in live:
                assert req.cached == 0
        elif op < 0.5:
            req = rng.choice(sim.running)
            if not sim.extend(req, rng.choices(range(3), k=rng.randrange(1, 6))):
                sim.finish(req)
        elif op < 0.6:
            sim.chunk(rng.choice(sim.running))
        elif op < 0.9:
            req = rng.choice(sim.running)
            sim.finish(req)
            if req.ns in live:
                match = sim.cache.match_prefix(req.ns, req.tokens)
                assert len(match.slots) == len(req.tokens) - len(req.tokens) % ps
                sim.verify(req.ns, req.tokens, match.slots)
        elif op < 0.97:
            sim.cache.evict(rng.randrange(1, 24))
        else:
            gone = live.pop(rng.randrange(len(live)))
            sim.cache.retire_namespace(gone)
            fresh = Namespace(f"v{step}")
            live.append(fresh)
            spaces.append(fresh)
        sim.check()
    for req in list(sim.running):
        sim.finish(req)
    assert sim.protected() == 0
    sim.cache.evict(10**6)
    sim.check()
    assert sim.alloc.available_size() == sim.alloc.size
