"""Which waiting requests run next: queue ordering (lpm / fcfs) and the PrefillAdder budgets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hotswap.engine.core.request import Req

# Matching every waiting request against the tree each step stops paying off past this.
LPM_MAX_QUEUE = 128


def order_waiting(waiting: list[Req], policy: str, prefix_len: Callable[[Req], int] | None
                  ) -> list[Req]:
    """lpm: longest cached prefix first (ties keep arrival order); fcfs: arrival order.

    `prefix_len` walks the tree, so it is called only where the order depends on it: under lpm
    with at most LPM_MAX_QUEUE waiting. None: no prefix cache, arrival order.
    """
    if policy == "lpm" and prefix_len is not None and len(waiting) <= LPM_MAX_QUEUE:
        return sorted(waiting, key=lambda r: -prefix_len(r))
    return list(waiting)


@dataclass
class NewTokenRatio:
    """Fraction of a running request's remaining max_new_tokens that admission reserves.

    It decays while decoding goes well (requests tend to stop early) and resets to its initial
    value after a retraction showed the reservation was too optimistic.
    """

    initial: float = 0.7
    minimum: float = 0.1
    decay: float = 0.002
    value: float = 0.7

    def step(self) -> None:
        self.value = max(self.minimum, self.value - self.decay)

    def reset(self) -> None:
        self.value = self.initial


class PrefillAdder:
    """Admits prefill work into one step within token, KV and running-request budgets."""

    def __init__(self, kv_available: int, reserved: int, max_prefill_tokens: int,
                 chunk_size: int, running: int, max_running: int, ratio: float,
                 page_size: int):
        self.kv_left = kv_available - reserved
        self.tokens_left = max_prefill_tokens
        self.chunk_size = chunk_size
        self.slots_left = max_running - running
        self.ratio = ratio
        self.page_size = page_size

    def room_for_new_request(self) -> bool:
        return self.slots_left > 0 and self.tokens_left > 0 and self.kv_left > 0

    def plan_extend(self, req: Req, extend: int, may_chunk: bool) -> int:
        """Tokens of `req` to prefill this step (0: does not fit)."""
        limit = self.tokens_left
        if self.chunk_size > 0:
            limit = min(limit, self.chunk_size)
        if extend > limit:
            if not may_chunk:
                return 0
            extend = limit // self.page_size * self.page_size or limit
        future = int(req.remaining_new_tokens * self.ratio)
        over = extend + future + self.page_size > self.kv_left
        if over and (not may_chunk or extend + self.page_size > self.kv_left):
            return 0
        return extend

    def take(self, req: Req, extend: int, new_request: bool) -> None:
        self.tokens_left -= extend
        future = int(req.remaining_new_tokens * self.ratio)
        self.kv_left -= extend + future + self.page_size
        if new_request:
            self.slots_left -= 1
