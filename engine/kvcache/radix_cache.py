"""Radix prefix cache: (namespace, token sequence) -> KV slots, with lock refs and LRU eviction.

Invariants (docs/design.md#invariants), kept here and checked by `check_integrity`:
1. Namespaces. Each Namespace has its own tree, so KV is shared only between equal namespaces. A
   retired namespace never matches and is never stored again; its unlocked nodes are freed at
   once, its locked ones when their last lock drops.
2. Conservation. allocator.available_size() + total_size() + slots held by running requests ==
   allocator.size. Requests hold whole pages: own tokens [p, L) with p page aligned hold
   ceil((L - p) / page_size) * page_size slots.
3. Locks. A node with lock_ref > 0 is never evicted. A lock counts on every node up to the root,
   so an unlocked node has an unlocked subtree.

Ownership protocol (every tree node holds whole pages):
- Admission: `m = match_prefix(ns, ids)`, then `inc_lock_ref(m.last_node)`, then
  `m = fetch_lower_tiers(ns, ids, m).match` (HiRadixCache: host/storage KV copied into fresh
  device slots and inserted; the lock moves to the longer match). The request borrows
  m.slots (p = len(m.slots), a page multiple, is its cached_tokens) and allocates its own slots
  for positions p.. (alloc_extend([p], [-1], ...)). Because p is page aligned those start on fresh
  pages, so a request never shares a page with the tree. Match `ids[:-1]` when the last token
  must be computed for its logits.
- Progress and finish: `cache_unfinished(ns, tokens, slots, last_node)` with `slots` every slot
  the request holds in position order and `tokens` the ids whose KV they hold. With a = the
  page-aligned length and n = insert(ns, tokens, slots): the tree takes slots[n:a], the
  request's duplicates slots[p:n] (the tree already had those tokens) are freed, and the lock
  moves to the new deepest node; the request writes the returned slots over its first positions
  and borrows them from then on. To finish, the request then frees its own tail (the slots past
  what it borrows) and drops its lock (KVManager.release).
- Peers within one step: a request admitted in the same step as another may borrow the whole
  pages the other is about to compute for a prefix they share (both rows run in one forward,
  and every backend stores a layer's new K/V before attending). Whichever inserts those tokens
  first hands the slots to the tree; the other finds the tree holding the very same slots, and
  duplicates that are the tree's own slots are not freed.
- Disabled cache or retired namespace: insert takes nothing and returns a, so the same frees
  release every slot the request owns; the borrowed slots of a retired tree go with the lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from hotswap.engine.core.namespace import Namespace
from hotswap.engine.kvcache.memory import TokenToKVPoolAllocator


class TreeNode:
    """An edge of page-aligned tokens and their KV slots. A root has no parent and no key."""

    __slots__ = ("ns", "parent", "children", "key", "value", "lock_ref", "last_access")

    def __init__(self, ns: Namespace | None, parent: TreeNode | None, key: list[int],
                 value: torch.Tensor, last_access: int = 0):
        self.ns = ns
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = last_access

    def is_evictable_leaf(self) -> bool:
        # Roots and removed nodes have no parent.
        return self.parent is not None and not self.children and self.lock_ref == 0


class MatchResult(NamedTuple):
    slots: torch.Tensor  # int64 KV slots of the matched prefix (length a page multiple)
    last_node: TreeNode  # deepest matched node: lock it while the request runs


class TierLoad(NamedTuple):
    """A device match after lower cache tiers (host, storage) extended it (HiRadixCache)."""

    match: MatchResult
    host_tokens: int = 0  # of match.slots, tokens copied back from the host tier
    storage_tokens: int = 0  # ... and read from the storage tier


def _no_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def _require(cond: bool, message: str) -> None:
    # Not `assert`: the idle loop's check must survive python -O.
    if not cond:
        raise AssertionError(f"radix cache integrity: {message}")


class RadixCache:
    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int, disable: bool = False):
        if allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        # Kept across reset(): a retired namespace must never serve KV again.
        self._retired: set[Namespace] = set()
        self._empty_root = TreeNode(None, None, [], _no_slots())
        self.reset()

    def reset(self) -> None:
        """Forget every node without freeing slots: only when idle, the caller clears the pool."""
        self._roots: dict[Namespace, TreeNode] = {}
        self._retired_roots: dict[Namespace, TreeNode] = {}
        # Lazy LRU heap of (last_access, seq, node); stale entries are skipped when popped.
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._seq = itertools.count()
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0

    def evictable_size(self) -> int:
        return self._evictable

    def total_size(self) -> int:
        return self._evictable + self._protected

    def namespaces(self) -> list[Namespace]:
        return list(self._roots)

    def match_prefix(self, ns: Namespace, tokens: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens` in `ns`; splits the edge it ends in."""
        root = self._roots.get(ns)
        end = self._aligned(len(tokens))
        if root is None or end == 0:
            return MatchResult(_no_slots(), root or self._empty_root)
        self._clock += 1
        node, _, values = self._walk(root, tokens, end)
        self._push_if_evictable(node)
        return MatchResult(torch.cat(values) if values else _no_slots(), node)

    def cached_len(self, ns: Namespace, tokens: list[int]) -> int:
        """How many leading tokens some tier could serve (the device only, here)."""
        return self.match_prefix(ns, tokens).slots.numel()

    def fetch_lower_tiers(self, ns: Namespace, tokens: list[int], match: MatchResult) -> TierLoad:
        """Extend a locked device match from lower tiers; there are none here."""
        return TierLoad(match)

    def write_through(self, node: TreeNode) -> None:
        """A request holding `node` leaves the batch: write its prefix to lower tiers where the
        policy says so; there are none here."""

    def insert(self, ns: Namespace, tokens: list[int], slots: torch.Tensor) -> int:
        """Store the page-aligned prefix; returns how many leading tokens the tree did not take.

        The tree takes slots[n:a] (a = the aligned length, n = the return value); the caller keeps
        ownership of everything else. When nothing may be stored, n == a.
        """
        return self._insert(ns, tokens, slots)[0]

    def _insert(self, ns: Namespace, tokens: list[int], slots: torch.Tensor
                ) -> tuple[int, torch.Tensor]:
        """insert(), also returning the tree's slots for the first n tokens (none when nothing
        may be stored)."""
        end = self._aligned(min(len(tokens), len(slots)))
        if self.disable or ns in self._retired or end == 0:
            return end, _no_slots()
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = TreeNode(ns, None, [], _no_slots())
        self._clock += 1
        node, pos, values = self._walk(root, tokens, end)
        if pos < end:
            leaf = TreeNode(ns, node, list(tokens[pos:end]), slots[pos:end].clone(), self._clock)
            node.children[self._child_key(leaf.key, 0)] = leaf
            self._num_nodes += 1
            self._evictable += end - pos
            node = leaf
        self._push_if_evictable(node)
        return pos, torch.cat(values) if values else _no_slots()

    def _free_duplicates(self, own: torch.Tensor, tree: torch.Tensor) -> None:
        """Free a request's slots for tokens the tree did not take from it, except those the
        tree holds itself (a request may borrow a peer's slots within one step, and the peer
        may have inserted them first). `tree`: the tree's slots at the same positions, if any."""
        keep = torch.zeros_like(own, dtype=torch.bool)
        keep[: tree.numel()] = own[: tree.numel()] == tree
        self.allocator.free(own[~keep])

    def cache_unfinished(self, ns: Namespace, tokens: list[int], slots: torch.Tensor,
                         last_node: TreeNode) -> MatchResult:
        """Insert a running request's computed prefix and move its lock to the new deepest node."""
        borrowed = self.path_len(last_node)
        end = self._aligned(min(len(tokens), len(slots)))
        if self.disable or ns in self._retired or end <= borrowed:
            return MatchResult(slots[:borrowed], last_node)
        n, tree_slots = self._insert(ns, tokens[:end], slots)
        self._free_duplicates(slots[borrowed:n], tree_slots[borrowed:n])
        match = self.match_prefix(ns, tokens[:end])
        self.inc_lock_ref(match.last_node)  # before the dec, so the shared path never unlocks
        self.dec_lock_ref(last_node)
        return match

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        retired = node.ns in self._retired
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on a node that is not locked")
            node.lock_ref -= 1
            parent = node.parent
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                if retired:  # children unlocked earlier and were freed then: this is a leaf
                    self._remove_leaf(node)
                else:
                    self._evictable += len(node.key)
                    self._push_if_evictable(node)
            node = parent
        if retired and not node.children:
            self._retired_roots.pop(node.ns, None)

    def evict(self, num_tokens: int) -> int:
        """Free least recently used unlocked leaves until `num_tokens` are freed or none is left."""
        freed = 0
        while freed < num_tokens and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if stamp != node.last_access or not node.is_evictable_leaf():
                continue
            parent = node.parent
            self._evictable -= len(node.key)
            self._on_evict(node)
            freed += self._remove_leaf(node)
            if parent.parent is None and not parent.children:
                del self._roots[parent.ns]  # many salts would otherwise leave empty roots behind
            else:
                self._push_if_evictable(parent)
        return freed

    def retire_where(self, predicate: Callable[[Namespace], bool]) -> None:
        """Retire every namespace in the tree that matches `predicate` (invariant 1)."""
        for ns in list(self._roots):
            if predicate(ns):
                self.retire_namespace(ns)

    def _on_evict(self, node: TreeNode) -> None:
        """Called with a leaf whose slots are about to be freed by eviction (not by retirement)."""

    def retire_namespace(self, ns: Namespace) -> None:
        """`ns` never matches and is never stored again; its unlocked KV is freed now."""
        self._retired.add(ns)
        root = self._roots.pop(ns, None)
        if root is None:
            return
        # An unlocked node's subtree is unlocked and follows it in pre-order: free in reverse.
        for node in reversed([n for n in self._iter_nodes(root) if n.lock_ref == 0]):
            self._evictable -= len(node.key)
            self._remove_leaf(node)
        if root.children:
            self._retired_roots[ns] = root

    def check_integrity(self, held_by_requests: int = 0) -> None:
        """Invariant 2 plus the tree's structure, sizes, locks, pages and LRU heap."""
        alloc = self.allocator
        free, tree = alloc.available_size(), self.total_size()
        _require(free + tree + held_by_requests == alloc.size,
                 f"free {free} + tree {tree} + requests {held_by_requests} != pool {alloc.size}")
        sizes = {False: 0, True: 0}
        values: list[torch.Tensor] = []
        live = {id(node) for stamp, _, node in self._heap if stamp == node.last_access}
        trees = [(r, False) for r in self._roots.values()]
        trees += [(r, True) for r in self._retired_roots.values()]
        for root, retired in trees:
            _require(root.parent is None and not root.key and root.lock_ref == 0, "bad root")
            _require((root.ns in self._retired) == retired, f"{root.ns} retired state mismatch")
            for node in self._iter_nodes(root):
                self._check_node(node, root.ns, retired)
                _require(not node.is_evictable_leaf() or id(node) in live,
                         "an evictable leaf is missing from the LRU heap")
                sizes[node.lock_ref > 0] += len(node.key)
                values.append(node.value)
        _require(len(values) == self._num_nodes, f"{len(values)} nodes, counted {self._num_nodes}")
        _require(sizes[False] == self._evictable, f"evictable {sizes[False]} != {self._evictable}")
        _require(sizes[True] == self._protected, f"protected {sizes[True]} != {self._protected}")
        self._check_pages(torch.cat(values) if values else _no_slots())

    def _check_node(self, node: TreeNode, ns: Namespace | None, retired: bool) -> None:
        ps = self.page_size
        _require(node.ns == ns, f"node of {node.ns} in the tree of {ns}")
        _require(len(node.key) > 0 and len(node.key) % ps == 0, f"key length {len(node.key)}")
        _require(node.value.numel() == len(node.key), "key and value lengths differ")
        parent = node.parent
        _require(parent is not None and parent.children.get(self._child_key(node.key, 0)) is node,
                 "node is not its parent's child under its first page")
        child_locks = sum(c.lock_ref for c in node.children.values())
        _require(node.lock_ref >= child_locks >= 0, f"lock_ref {node.lock_ref} < {child_locks}")
        _require(not retired or node.lock_ref > 0, "unlocked node left in a retired tree")

    def _check_pages(self, values: torch.Tensor) -> None:
        ps = self.page_size
        rows = values.view(-1, ps)
        _require(bool((rows - rows[:, :1] == torch.arange(ps)).all()), "a page is not contiguous")
        _require(bool((rows[:, 0] % ps == 0).all()), "a node starts inside a page")
        pages = (rows[:, 0] // ps).tolist()
        _require(len(set(pages)) == len(pages), "a page is held twice by the tree")
        _require(all(1 <= p <= self.allocator.num_pages for p in pages), "page out of range")
        _require(not set(pages) & set(self.allocator.free_pages), "a tree page is also free")

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _child_key(self, tokens: list[int], pos: int) -> int | tuple[int, ...]:
        return tokens[pos] if self.page_size == 1 else tuple(tokens[pos: pos + self.page_size])

    def _walk(self, root: TreeNode, tokens: list[int],
              end: int) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow tokens[:end] down from root, touching nodes; split a partly matched edge."""
        node, pos, values = root, 0, []
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            n = self._common_len(child.key, tokens, pos, end)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            values.append(child.value)
            node, pos = child, pos + n
        return node, pos, values

    def _common_len(self, key: list[int], tokens: list[int], pos: int, end: int) -> int:
        limit = min(len(key), end - pos)
        i = 0
        while i < limit and key[i] == tokens[pos + i]:
            i += 1
        return self._aligned(i)

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Put a new node holding node's first n tokens between node and its parent."""
        mid = TreeNode(node.ns, node.parent, node.key[:n], node.value[:n], node.last_access)
        mid.lock_ref = node.lock_ref  # every lock on node passes through mid
        mid.parent.children[self._child_key(mid.key, 0)] = mid
        node.key, node.value, node.parent = node.key[n:], node.value[n:], mid
        mid.children[self._child_key(node.key, 0)] = node
        self._num_nodes += 1
        return mid

    def path_len(self, node: TreeNode) -> int:
        total = 0
        while node.parent is not None:
            total += len(node.key)
            node = node.parent
        return total

    def _push_if_evictable(self, node: TreeNode) -> None:
        if not node.is_evictable_leaf():
            return
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(n.last_access, next(self._seq), n) for root in self._roots.values()
                      for n in self._iter_nodes(root) if n.is_evictable_leaf()]
        heapq.heapify(self._heap)

    def _remove_leaf(self, node: TreeNode) -> int:
        """Free a leaf's slots and detach it; the caller fixes the size counters."""
        _require(not node.children and node.parent is not None, "removing a non-leaf")
        self.allocator.free(node.value)
        del node.parent.children[self._child_key(node.key, 0)]
        node.parent = None
        self._num_nodes -= 1
        return len(node.key)

    @staticmethod
    def _iter_nodes(root: TreeNode) -> Iterator[TreeNode]:
        """Pre-order walk (a parent before its children), without recursion: trees can be deep."""
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
