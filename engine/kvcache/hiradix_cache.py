"""HiRadixCache: the radix cache over three tiers (device pool, host pool, shared storage).

It decides where a prefix's KV lives:
- Device eviction writes back. A device leaf chosen by LRU eviction is copied into the host
  pool (only the part the host does not already hold) before its slots are freed, and its
  whole blocks are written to storage when a storage tier is configured. With the
  write-through policy the same copy also happens when a request leaves the batch (finished,
  aborted or retracted), for the prefix it held, so storage has it before any eviction.
- Admission loads back. After the device match is locked, `fetch_lower_tiers` copies the host
  tier's longer match into fresh device slots, then whole storage blocks past that, inserts
  them into the device tree and moves the request's lock onto the longer match.
- The host tier is a second radix tree over the host pool with its own LRU eviction; nothing
  but this class locks it, and only for the length of one copy, so its eviction never takes
  the pages being copied.
- Retirement spans every tier: a retired namespace is retired in the device and host trees
  (never matched or stored again, pages freed) and its storage folder is deleted. Storage keys
  also carry a fingerprint of the weights that produced the KV (a version label alone could be
  reused by another run), so a file is only found by an engine serving those same weights.
  Adapter namespaces stay out of storage: an adapter's version number is per process.

Conservation holds per tier: device as in RadixCache; host: free + host tree == host pool size
(no request holds host slots). `check_integrity` checks both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import torch

from hotswap.engine.config import EngineConfig
from hotswap.engine.core.namespace import Namespace, ServingVersion
from hotswap.engine.kvcache.host_pool import HostKVPool
from hotswap.engine.kvcache.memory import KVPool, TokenToKVPoolAllocator
from hotswap.engine.kvcache.radix_cache import MatchResult, RadixCache, TierLoad, TreeNode
from hotswap.engine.kvcache.storage import KVStorage, weights_fingerprint


class HiRadixCache(RadixCache):
    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int, host: HostKVPool,
                 storage: KVStorage | None = None,
                 weights_identity: Callable[[str], str | None] | None = None,
                 write_through: bool = False):
        """`weights_identity(weight_version)` names the weights serving that version (None when
        that version is not the one loaded): part of every storage key."""
        if storage is not None and storage.block_tokens % page_size:
            raise ValueError(f"storage block of {storage.block_tokens} tokens is not a multiple "
                             f"of page_size {page_size}")
        self.host = host
        self.host_tree = RadixCache(host.allocator, page_size)
        self.storage = storage
        self._write_through = write_through
        self._weights_identity = weights_identity or (lambda version: None)
        self._storage_keys: dict[Namespace, str] = {}
        self.stats = {"host_backup_tokens": 0, "host_load_tokens": 0,
                      "storage_write_tokens": 0, "storage_load_tokens": 0}
        super().__init__(allocator, page_size)

    def reset(self) -> None:
        """Forget every cached prefix on the device and host tiers (storage is shared: kept)."""
        super().reset()
        self.host_tree.reset()
        self.host.allocator.clear()

    def cached_len(self, ns: Namespace, tokens: list[int]) -> int:
        device = super().cached_len(ns, tokens)
        return max(device, self.host_tree.cached_len(ns, tokens))

    # device eviction: write back (and write through when a request leaves, by policy)

    def _on_evict(self, node: TreeNode) -> None:
        self._write_down(node)

    def write_through(self, node: TreeNode) -> None:
        if self._write_through and node.parent is not None and node.ns not in self._retired:
            self._write_down(node)

    def _write_down(self, node: TreeNode) -> None:
        """Host (and storage) tiers take the prefix from the root to the end of `node`."""
        tokens, slots = self._path(node)
        host_slots = self._backup(node.ns, tokens, slots)
        if host_slots is not None:
            self._write_storage(node.ns, tokens, host_slots)

    def _path(self, node: TreeNode) -> tuple[list[int], torch.Tensor]:
        """Tokens and device slots from the root down to the end of `node`."""
        keys, values = [], []
        while node.parent is not None:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        return [t for key in reversed(keys) for t in key], torch.cat(values[::-1])

    def _backup(self, ns: Namespace, tokens: list[int], device_slots: torch.Tensor
                ) -> torch.Tensor | None:
        """Make the host tier hold `tokens`; returns its slots for them (None: no room)."""
        tree = self.host_tree
        match = tree.match_prefix(ns, tokens)
        have = match.slots.numel()
        if have >= len(tokens):
            return match.slots
        tree.inc_lock_ref(match.last_node)  # host eviction below must not take this prefix
        try:
            new = self._host_alloc(len(tokens) - have)
            if new is None:
                return None
            self.host.backup(device_slots[have:], new)
            slots = torch.cat((match.slots, new))
            taken_from = tree.insert(ns, tokens, slots)
            self.host.allocator.free(slots[have:taken_from])  # not taken: a retired namespace
            if taken_from > have:
                return None
            self.stats["host_backup_tokens"] += len(tokens) - have
            return slots
        finally:
            tree.dec_lock_ref(match.last_node)

    def _host_alloc(self, num_tokens: int) -> torch.Tensor | None:
        short = num_tokens - self.host.allocator.available_size()
        if short > self.host_tree.evictable_size():
            return None  # would not fit even after evicting every unlocked host page
        if short > 0:
            self.host_tree.evict(short)
        return self.host.allocator.alloc(num_tokens)

    def _write_storage(self, ns: Namespace, tokens: list[int], host_slots: torch.Tensor) -> None:
        key = self._storage_key(ns)
        if key is None:
            return
        B = self.storage.block_tokens
        for k, block_hash in enumerate(self.storage.block_hashes(key, tokens)):
            if self.storage.contains(key, block_hash):
                continue
            block = slice(k * B, (k + 1) * B)
            if self.storage.save(key, block_hash, tokens[block], self.host.read(host_slots[block])):
                self.stats["storage_write_tokens"] += B

    # admission: load back

    def fetch_lower_tiers(self, ns: Namespace, tokens: list[int], match: MatchResult) -> TierLoad:
        """Extend the locked device `match` with host and storage KV; the lock moves with it."""
        have = match.slots.numel()
        end = self._aligned(len(tokens))
        if self.disable or ns in self._retired or end <= have:
            return TierLoad(match)
        host_match = self.host_tree.match_prefix(ns, tokens)
        self.host_tree.inc_lock_ref(host_match.last_node)  # device eviction backs up to host
        try:
            host_end = max(have, host_match.slots.numel())
            stored = self._read_storage(ns, tokens, host_end, end)
            total = host_end - have + (0 if stored is None else stored.shape[1])
            slots = self._device_alloc(total)
            if slots is None:
                return TierLoad(match)
            if host_end > have:
                self.host.load(host_match.slots[have:host_end], slots[: host_end - have])
            if stored is not None:
                self.host.write_device(stored, slots[host_end - have:])
            new = self._adopt(ns, tokens[: have + total], match, slots)
        finally:
            self.host_tree.dec_lock_ref(host_match.last_node)
        self.stats["host_load_tokens"] += host_end - have
        self.stats["storage_load_tokens"] += total - (host_end - have)
        return TierLoad(new, host_end - have, total - (host_end - have))

    def _read_storage(self, ns: Namespace, tokens: list[int], start: int, end: int
                      ) -> torch.Tensor | None:
        """KV for tokens [start, e) from consecutive storage blocks (e as far as they go)."""
        key = self._storage_key(ns)
        if key is None:
            return None
        B = self.storage.block_tokens
        first = start // B
        blocks = []
        for k, block_hash in enumerate(self.storage.block_hashes(key, tokens[:end])):
            if k < first:
                continue
            kv = self.storage.load(key, block_hash, tokens[k * B: (k + 1) * B])
            if kv is None:
                break
            blocks.append(kv)
        if not blocks:
            return None
        kv = torch.cat(blocks, dim=1)[:, start - first * B:]
        return kv if kv.shape[1] else None

    def _device_alloc(self, num_tokens: int) -> torch.Tensor | None:
        short = num_tokens - self.allocator.available_size()
        if short > self.evictable_size():
            return None  # the request computes its prefix instead
        if short > 0:
            self.evict(short)
        return self.allocator.alloc(num_tokens) if num_tokens else None

    def _adopt(self, ns: Namespace, tokens: list[int], match: MatchResult, slots: torch.Tensor
               ) -> MatchResult:
        """Insert loaded KV behind `match` and move the request's lock to the longer match."""
        have = match.slots.numel()
        taken_from = self.insert(ns, tokens, torch.cat((match.slots, slots)))
        self.allocator.free(slots[: taken_from - have])
        new = self.match_prefix(ns, tokens)
        self.inc_lock_ref(new.last_node)
        self.dec_lock_ref(match.last_node)
        return new

    # retirement

    def retire_namespace(self, ns: Namespace) -> None:
        super().retire_namespace(ns)
        self.host_tree.retire_namespace(ns)
        key = self._storage_keys.pop(ns, None)
        if key is not None and self.storage is not None:
            self.storage.retire(key)

    def retire_where(self, predicate: Callable[[Namespace], bool]) -> None:
        known = set(self.namespaces()) | set(self.host_tree.namespaces()) | set(self._storage_keys)
        for ns in known:
            if predicate(ns):
                self.retire_namespace(ns)

    def _storage_key(self, ns: Namespace) -> str | None:
        if self.storage is None or ns.adapter_name is not None or ns in self._retired:
            return None
        key = self._storage_keys.get(ns)
        if key is None:
            identity = self._weights_identity(ns.weight_version)
            if identity is None:
                return None
            pool = self.host.device_pool
            key = json.dumps({
                "weights": identity, "weight_version": ns.weight_version,
                "cache_salt": ns.cache_salt, "layers": pool.num_layers,
                "kv_heads": pool.num_kv_heads, "head_dim": pool.head_dim,
                "dtype": str(pool.dtype), "block_tokens": self.storage.block_tokens},
                sort_keys=True)
            self._storage_keys[ns] = key
        return key

    def check_integrity(self, held_by_requests: int = 0) -> None:
        super().check_integrity(held_by_requests)
        self.host_tree.check_integrity(0)


STORAGE_BLOCK_TOKENS = 64  # tokens per storage file (rounded up to whole pages)


def make_radix_cache(config: EngineConfig, allocator: TokenToKVPoolAllocator, kv_pool: KVPool,
                     weights: Callable[[], Iterable[torch.Tensor]],
                     serving: ServingVersion, batch_invariant: bool = False) -> RadixCache:
    """The engine's prefix cache: a HiRadixCache when `enable_hierarchical_cache` is set.

    `weights()` yields the model's tensors and `serving` names the version they serve;
    together they give storage keys a fingerprint of the weights. deterministic=True keeps the
    cache only where the forward is batch-invariant (a hit then gives the bits of computing the
    prefix); where it runs rows alone instead, the cache is off."""
    page_size = config.page_size
    disable = not config.enable_prefix_cache or (config.deterministic and not batch_invariant)
    if not config.enable_hierarchical_cache:
        return RadixCache(allocator, page_size, disable=disable)
    host_tokens = config.hicache_host_tokens or int(allocator.size * config.hicache_ratio)
    host = HostKVPool(host_tokens, kv_pool)
    storage = None
    if config.hicache_storage_dir:
        block = -(-STORAGE_BLOCK_TOKENS // page_size) * page_size
        storage = KVStorage(config.hicache_storage_dir, block)

    def identity(version: str) -> str | None:
        return weights_fingerprint(weights()) if version == serving.label else None

    return HiRadixCache(allocator, page_size, host, storage, identity,
                        write_through=config.hicache_write_policy == "write_through")
