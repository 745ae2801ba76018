"""GRPO advantages and group filters.

`grpo_advantages`: one number per trajectory, (reward - group mean) / (group population std +
1e-6) with scale="group" (Dr. GRPO's scale="none" skips the division; "batch" divides by the
batch's std). A NaN reward (timeout, failed reward) gets advantage 0 and is left out of its
group's mean and std.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from hotswap.rollout.trajectory import Trajectory

EPS = 1e-6
GroupFilter = Callable[[list[Trajectory]], bool]


def grpo_advantages(rewards: Sequence[float], group_ids: Sequence[int],
                    scale: str = "group") -> list[float]:
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if len(rewards) != len(group_ids):
        raise ValueError("rewards and group_ids differ in length")
    groups: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids):
        if not math.isnan(r):
            groups.setdefault(g, []).append(float(r))
    means = {g: sum(v) / len(v) for g, v in groups.items()}
    centred = [0.0 if math.isnan(r) else float(r) - means[g] for r, g in zip(rewards, group_ids)]
    if scale == "none":
        return centred
    if scale == "batch":
        valid = [float(r) for r in rewards if not math.isnan(r)]
        std = _pstd(valid)
        return [c / (std + EPS) for c in centred]
    stds = {g: _pstd(v) for g, v in groups.items()}
    return [c if math.isnan(r) else c / (stds[g] + EPS)
            for c, r, g in zip(centred, rewards, group_ids)]


def _pstd(values: list[float]) -> float:
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def nonzero_std(eps: float = 1e-8) -> GroupFilter:
    """Keep a group only if its rewards differ (a group of equal rewards has no gradient)."""

    def keep(group: list[Trajectory]) -> bool:
        valid = [t.reward for t in group if not math.isnan(t.reward)]
        return len(valid) > 1 and _pstd(valid) > eps

    keep.__name__ = "nonzero_std"
    return keep
