"""collect(): rows -> groups -> rewards -> filter -> advantages -> one RolloutBatch.

Groups run concurrently (the engine batches them continuously). With a filter, rows are
over-sampled until `target_groups` groups pass; the requests still running then are aborted.
Every group started is accounted for in `batch.meta["groups"]`: kept, filtered or aborted.
Each group is scored in its own thread as soon as it finishes, while the others generate;
`batch.meta["reward_s"]` sums the seconds the scored groups' rewards took.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from hotswap.rollout.advantages import GroupFilter, grpo_advantages
from hotswap.rollout.client import TokenClient
from hotswap.rollout.rewards import RewardFn, score_group
from hotswap.rollout.trajectory import RolloutBatch, Trajectory


def as_client(backend: Any, sampling: dict | None = None) -> TokenClient:
    if isinstance(backend, TokenClient):
        if sampling:
            raise ValueError("sampling: give it to the TokenClient, not with one")
        return backend
    return TokenClient(backend, sampling=sampling)


def collect(client: Any, loop: Any, rows: Sequence[dict], group_size: int = 8,
            reward: RewardFn | None = None, filter: GroupFilter | None = None,
            target_groups: int | None = None, over_sample: int = 0, seed: int | None = 0,
            scale: str = "group", reward_timeout_s: float | None = 30.0,
            max_concurrent_groups: int = 64) -> RolloutBatch:
    """Sample `group_size` trajectories per row with `loop` (SingleTurn, ToolLoop ...).

    target_groups: how many groups the batch needs (default: every row). over_sample: groups
    started beyond that from the start (rows are drawn in order; failing groups draw more).
    """
    client = as_client(client)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    target = len(rows) if target_groups is None else target_groups
    if not 0 < target <= len(rows):
        raise ValueError(f"target_groups must be in 1..{len(rows)} (the rows given)")
    start = time.perf_counter()
    client.cancelled.clear()
    kept, counts, scored, reward_s = _run_groups(client, loop, rows, group_size, reward, filter,
                                                 target, over_sample, seed, reward_timeout_s,
                                                 max_concurrent_groups)
    trajs = [t for group in kept for t in group]
    advantages = grpo_advantages([t.reward for t in trajs], [t.group_id for t in trajs], scale)
    meta = {"groups": counts, "seconds": time.perf_counter() - start, "scored_rewards": scored,
            "reward_s": reward_s, "sampling": dict(client.sampling),
            "weight_version": client.weight_version()}
    return RolloutBatch.from_trajectories(trajs, advantages, meta)


def _run_groups(client: TokenClient, loop: Any, rows: Sequence[dict], group_size: int,
                reward: RewardFn | None, keep: GroupFilter | None, target: int,
                over_sample: int, seed: int | None, timeout_s: float | None,
                concurrency: int
                ) -> tuple[list[list[Trajectory]], dict[str, int], list[float], float]:
    counts = {"started": 0, "kept": 0, "filtered": 0, "aborted": 0}
    scored: list[float] = []  # every completed group's rewards, kept or filtered
    reward_s = 0.0  # the seconds their scoring took
    kept: list[list[Trajectory]] = []
    next_row = 0

    def one_group(gid: int) -> tuple[list[Trajectory], float]:
        group_seed = None if seed is None else seed * 1_000_003 + gid
        trajs = loop.run_group(client, rows[gid], group_size, gid, seed=group_seed)
        if client.cancelled.is_set():
            return trajs, 0.0
        return trajs, score_group(trajs, reward, timeout_s)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="rollout") as pool:
        running: dict[Future, int] = {}

        def launch(k: int) -> None:
            nonlocal next_row
            while k > 0 and next_row < len(rows):
                running[pool.submit(one_group, next_row)] = next_row
                next_row, k = next_row + 1, k - 1
                counts["started"] += 1

        launch(min(concurrency, target + over_sample))
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                running.pop(fut)
                group, seconds = fut.result()
                if len(kept) >= target or any(t.finish_reason == "abort" for t in group):
                    counts["aborted"] += 1
                    continue
                scored.extend(t.reward for t in group)
                reward_s += seconds
                if keep is None or keep(group):
                    kept.append(group)
                    counts["kept"] += 1
                else:
                    counts["filtered"] += 1
            if len(kept) >= target:
                client.abort_inflight()
            else:
                launch(target - len(kept) - len(running) + over_sample)
    return kept, counts, scored, reward_s

