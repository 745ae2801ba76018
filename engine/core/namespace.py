"""The radix cache key's namespace: what produced a KV entry (DESIGN invariant 1)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Namespace:
    """What produced a KV entry; entries are shared only within one equal Namespace."""

    weight_version: str
    adapter_name: str | None = None
    adapter_version: int = 0
    cache_salt: str | None = None
    # Which weights, when a version label is reused for other weights (a trainer that labels
    # its first push "0", like the checkpoint it loaded): bumped at every weight change.
    weight_epoch: int = 0


class ServingVersion:
    """The weights being served: their version label and their epoch (weight changes served so
    far, the namespaces' weight_epoch). The weight transactions write it on the scheduler
    thread; the scheduler and the cache read it."""

    __slots__ = ("label", "epoch")

    def __init__(self, label: str = "0") -> None:
        self.label = label
        self.epoch = 0
