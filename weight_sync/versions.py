"""Weight versions: the one order every layer compares their labels in.

A weight version is the label a trainer gives a push ("7", "step-12", "v2.1"); the engine stamps
every token with it. Labels compare in natural order: as text, except that each run of digits
compares as a number ("9" < "10", "step-9" < "step-10", "v1.9" < "v1.10"). A label that counts
its pushes in digits therefore orders as the pushes were made. Limit: a label that carries no
count (a hash, a name) has no order of its own; it sorts as text, which says nothing about which
weights came first, and `VersionOrder.served` warns when the engine's version moves backwards.

How far apart two versions are (a lag, staleness) is counted in pushes: the difference of the
labels' last numbers when the labels differ only there ("7" -> "10" and "step-7" -> "step-10":
3), else the number of versions seen that order after the older, up to the newer ("0" ->
"step-0": 1). A VersionOrder holds the versions one client has seen (the engine's at each read,
every token's) and counts lags.
"""

from __future__ import annotations

import bisect
import logging
import re
import threading
from collections.abc import Iterable

logger = logging.getLogger("hotswap.weight_sync")

_DIGITS = re.compile(r"([0-9]+)")

# Text at even positions, (value, digits) at odd ones: two keys never compare str with int.
VersionKey = tuple[str | tuple[int, str], ...]


def version_key(label: str) -> VersionKey:
    """The sort key of a label: its digit runs as numbers ("07" and "7" tie, broken by text)."""
    parts = _DIGITS.split(label)
    return tuple((int(p), p) if i % 2 else p for i, p in enumerate(parts))


def newest(labels: Iterable[str]) -> str:
    """The label that orders last; ValueError for none."""
    return max(labels, key=version_key)


def next_version(label: str) -> str:
    """A label that orders after `label`: its last number plus one, its zero padding kept
    ("7" -> "8", "step-9" -> "step-10", "ckpt-009" -> "ckpt-010"); "-1" appended to a label
    without digits ("main" -> "main-1")."""
    parts = _DIGITS.split(label)
    if len(parts) == 1:
        return f"{label}-1"
    number = parts[-2]
    parts[-2] = str(int(number) + 1).zfill(len(number))
    return "".join(parts)


def number_gap(newer: str, older: str) -> int | None:
    """newer's last number minus older's, when the labels differ in nothing else; else None."""
    a, b = version_key(newer), version_key(older)
    if len(a) != len(b) or len(a) < 3 or a[:-2] != b[:-2] or a[-1] != b[-1]:
        return None
    (new_number, _), (old_number, _) = a[-2], b[-2]
    return new_number - old_number


class VersionOrder:
    """The versions one client has seen, in version order, and the lags between them
    (thread-safe). Where two labels differ in more than their last number, a lag counts seen
    versions: a reader of the engine's version at every batch (collect, AsyncRollout) sees
    each version pushed between batches."""

    def __init__(self, labels: Iterable[str] = ()) -> None:
        self._keys: list[VersionKey] = []
        self._labels: list[str] = []
        self._served: str | None = None
        self._lock = threading.Lock()
        self.see(*labels)

    def see(self, *labels: str) -> None:
        with self._lock:
            for label in labels:
                self._index(label)

    @property
    def labels(self) -> list[str]:
        """Every version seen, oldest first."""
        with self._lock:
            return list(self._labels)

    def lag(self, newer: str, older: str) -> int:
        """How many pushes `older` is behind `newer` (module docstring; negative when `older`
        orders after `newer`)."""
        return self.lags(newer, [older])[0]

    def lags(self, newer: str, labels: Iterable[str]) -> list[int]:
        """lag(newer, label) for each label, every label seen before any lag is counted."""
        labels = list(labels)
        with self._lock:
            for label in [newer, *labels]:
                self._index(label)
            top = self._index(newer)
            gaps = [number_gap(newer, label) for label in labels]
            return [top - self._index(label) if gap is None else gap
                    for label, gap in zip(labels, gaps)]

    def served(self, label: str) -> None:
        """`label` is what the engine serves now. A label that orders before the one served
        at the previous read means labels that do not count up (lags are then wrong): warned."""
        with self._lock:
            self._index(label)
            last, self._served = self._served, label
        if last is not None and version_key(label) < version_key(last):
            logger.warning("weight version %r follows %r but orders before it: lags and "
                           "staleness count versions in the order of their labels, whose "
                           "digits must count up (docs/api.md#weight-versions)", label, last)

    def _index(self, label: str) -> int:
        key = version_key(label)
        i = bisect.bisect_left(self._keys, key)
        if i == len(self._keys) or self._keys[i] != key:
            self._keys.insert(i, key)
            self._labels.insert(i, label)
        return i
