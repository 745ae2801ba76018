"""Sessions: a conversation's KV kept in the prefix cache across turns, while its tools run.

A session holds one lock (radix_cache.py, invariant 3) on the tree node that ends its last
finished turn, prompt and output, so eviction never takes that path and the next turn, whose
prompt starts with it, prefills only its new tokens. Each finished turn moves the pin to its own
path. A pin is dropped when the session closes, when its time-to-live passes without a turn,
when the engine's pin budget needs the room for a more recent turn, and when a weight update
retires its namespace: that KV was computed by the old weights, so the next turn prefills under
the new version (dropping the lock frees it, as for any retired KV).

Everything here runs on the scheduler thread, except `known`, a read of a dict that callers
use to refuse unknown ids at submit.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from hotswap.engine.kvcache.radix_cache import RadixCache, TreeNode

logger = logging.getLogger(__name__)


@dataclass
class Session:
    id: str
    ttl_s: float
    expires: float
    node: TreeNode | None = None  # the pinned end of the last finished turn
    tokens: int = 0  # tokens on the pinned path
    used: int = 0  # a clock: the turn that pinned last


class Sessions:
    def __init__(self, tree: RadixCache, budget: Callable[[], int]):
        self.tree = tree
        self.budget = budget  # tokens all pins may hold together
        self._sessions: dict[str, Session] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def known(self, session_id: str) -> bool:
        return session_id in self._sessions

    def open(self, ttl_s: float, session_id: str | None = None) -> str:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise ValueError("session_id must be a non-empty string")
        session_id = session_id or f"session-{uuid.uuid4().hex}"
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already open")
        self._sessions[session_id] = Session(session_id, ttl_s, time.monotonic() + ttl_s)
        return session_id

    def close(self, session_id: str) -> bool:
        """False when no such session is open."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._unpin(session)
        return True

    def pin(self, session_id: str, node: TreeNode) -> None:
        """A turn of the session finished with its KV ending at `node` (locked by the turn)."""
        session = self._sessions.get(session_id)
        if session is None:  # closed while its turn ran
            return
        session.expires = time.monotonic() + session.ttl_s
        tokens = self.tree.path_len(node)
        if tokens > self.budget():
            self._unpin(session)
            logger.warning("session %s: %d tokens exceed the session budget (%d); not pinned",
                           session_id, tokens, self.budget())
            return
        self.tree.inc_lock_ref(node)  # before the old pin's drop: a shared path stays locked
        self._unpin(session)
        self._clock += 1
        session.node, session.tokens, session.used = node, tokens, self._clock
        self._fit(keep=session)

    def _fit(self, keep: Session) -> None:
        """Drop the least recently pinned other sessions' pins until all fit the budget."""
        pinned = sorted((s for s in self._sessions.values()
                         if s.node is not None and s is not keep), key=lambda s: s.used)
        while pinned and self.pinned_tokens() > self.budget():
            self._unpin(pinned.pop(0))

    def pinned_tokens(self) -> int:
        return sum(s.tokens for s in self._sessions.values())

    def expire(self, now: float) -> None:
        for session in [s for s in self._sessions.values() if s.expires <= now]:
            del self._sessions[session.id]
            self._unpin(session)

    def seconds_to_expiry(self) -> float | None:
        """How long until the next session expires; None when none is open."""
        if not self._sessions:
            return None
        return max(0.0, min(s.expires for s in self._sessions.values()) - time.monotonic())

    def unpin_retired(self, retired: Callable[[object], bool]) -> None:
        """Drop the pins in namespaces a weight update retired (their KV is freed with them)."""
        for session in self._sessions.values():
            if session.node is not None and retired(session.node.ns):
                self._unpin(session)

    def forget_pins(self) -> None:
        """The tree was emptied (flush): the pinned nodes are gone without their locks."""
        for session in self._sessions.values():
            session.node, session.tokens = None, 0

    def _unpin(self, session: Session) -> None:
        if session.node is not None:
            self.tree.dec_lock_ref(session.node)
            session.node, session.tokens = None, 0

    def stats(self) -> dict[str, int]:
        return {"open": len(self._sessions),
                "pinned": sum(s.node is not None for s in self._sessions.values()),
                "pinned_tokens": self.pinned_tokens()}
