"""AsyncRollout: groups are sampled in background threads while the trainer trains.

Admission follows AReaL's staleness rule: a new group starts only while
    accepted + running < (max_staleness + version + 1) x batch_groups
(accepted counts every group accepted so far, handed out or waiting; version counts the weight
versions since start()), so sampling never runs more than `max_staleness` batches ahead of
training.
When a batch is handed out, each group is checked again: a trajectory with a trainable token
more than `max_staleness` versions older than the engine's version is dropped (`stale="drop"`,
the whole group) or has those tokens masked (`stale="mask"`).

At hand-out the groups still running are, with `partial=True`, carried into a later batch (their
requests continue across the weight update; tokens keep the versions that produced them), or,
with `partial=False`, aborted and their rows sampled again. Nothing is lost: every group started
is accepted, filtered, dropped with a reason, or still waiting/running (`accounting()`).

Versions are any labels, in the one order of weight_sync/versions.py (digit runs compare as
numbers: "step-9" < "step-10"), and a lag counts pushes: the difference of two labels' numbers
where they differ only there, else the versions the client saw in between. The runner reads the
engine's version at every admission check (every 50 ms) and hand-out.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hotswap.rollout.advantages import GroupFilter, grpo_advantages
from hotswap.rollout.client import TokenClient
from hotswap.rollout.collect import as_client
from hotswap.rollout.rewards import RewardFn, score_group
from hotswap.rollout.trajectory import RolloutBatch, Trajectory


@dataclass
class _Group:
    gid: int
    row_index: int
    client: TokenClient
    started_version: str
    carried: int = 0  # hand-outs this group was in flight for
    trajs: list[Trajectory] = field(default_factory=list)


class AsyncRollout:
    def __init__(self, engine: Any, loop: Any, rows: Sequence[dict], group_size: int = 8,
                 batch_groups: int = 16, reward: RewardFn | None = None,
                 max_staleness: int = 1, partial: bool = False, stale: str = "drop",
                 filter: GroupFilter | None = None, sampling: dict | None = None,
                 seed: int | None = 0, scale: str = "group",
                 reward_timeout_s: float | None = 30.0, max_concurrent_groups: int = 64):
        if stale not in ("drop", "mask"):
            raise ValueError(f"stale must be 'drop' or 'mask', got {stale!r}")
        if max_staleness < 0 or batch_groups < 1 or group_size < 1 or not rows:
            raise ValueError("max_staleness >= 0, batch_groups >= 1, group_size >= 1 and "
                             "non-empty rows are required")
        self.client = as_client(engine, sampling)
        self.loop, self.rows, self.group_size = loop, list(rows), group_size
        self.batch_groups, self.reward, self.filter = batch_groups, reward, filter
        self.max_staleness, self.partial, self.stale = max_staleness, partial, stale
        self.seed, self.scale, self.reward_timeout_s = seed, scale, reward_timeout_s
        self.max_concurrent = max_concurrent_groups
        self._cond = threading.Condition()
        self._ready: list[_Group] = []
        self._running: dict[int, _Group] = {}
        self._retry: list[int] = []  # rows whose group was aborted at a hand-out
        self._ids = itertools.count()
        self._rows = itertools.cycle(range(len(self.rows)))
        self._first_version = ""  # the engine's at start(): admission counts versions from it
        self._scored: list[float] = []  # rewards of every group scored since the last hand-out
        self._reward_s = 0.0  # the seconds their scoring took
        self.counts: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    # lifecycle

    def start(self) -> AsyncRollout:
        if self._thread is not None:
            raise RuntimeError("AsyncRollout already started")
        self._pool = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="async-rollout")
        self._first_version = self.client.weight_version()
        self._thread = threading.Thread(target=self._admit_loop, name="async-admit",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Abort what is running; running groups are accounted as dropped ("stopped")."""
        self._stop.set()
        with self._cond:
            running = list(self._running.values())
            self._cond.notify_all()
        for group in running:
            group.client.abort_inflight()
        if self._thread is not None:
            self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> AsyncRollout:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # admission (background thread)

    def _admit_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while self._can_admit():
                    self._launch()
                self._cond.wait(0.05)

    def _can_admit(self) -> bool:
        accepted = self.counts["accepted"] + len(self._ready)
        updates = self.client.versions.lag(self.client.weight_version(), self._first_version)
        capacity = (self.max_staleness + updates + 1) * self.batch_groups
        return (not self._stop.is_set() and len(self._running) < self.max_concurrent
                and accepted + len(self._running) < capacity)

    def _launch(self) -> None:
        row_index = self._retry.pop(0) if self._retry else next(self._rows)
        group = _Group(next(self._ids), row_index, self.client.sibling(),
                       self.client.weight_version())
        self._running[group.gid] = group
        self.counts["started"] += 1
        assert self._pool is not None
        self._pool.submit(self._run_group, group)

    def _run_group(self, group: _Group) -> None:
        seed = None if self.seed is None else self.seed * 1_000_003 + group.gid
        seconds = 0.0
        try:
            trajs = self.loop.run_group(group.client, self.rows[group.row_index],
                                        self.group_size, group.gid, seed=seed)
            aborted = any(t.finish_reason == "abort" for t in trajs)
            if not aborted:  # scored here, in the group's thread, while other groups generate
                seconds = score_group(trajs, self.reward, self.reward_timeout_s)
            outcome = "aborted" if aborted else (
                "accepted" if self.filter is None or self.filter(trajs) else "filtered")
        except Exception as exc:  # a broken row or tool: account for it and keep going
            trajs, outcome = [], f"error: {type(exc).__name__}: {exc}"
        with self._cond:
            self._finish(group, trajs, outcome, seconds)
            self._cond.notify_all()

    def _finish(self, group: _Group, trajs: list[Trajectory], outcome: str,
                reward_s: float) -> None:
        if self._running.pop(group.gid, None) is None:
            return  # already accounted for (aborted at a hand-out)
        group.trajs = trajs
        if outcome in ("accepted", "filtered"):
            self._scored += [t.reward for t in trajs]
            self._reward_s += reward_s
        if outcome == "accepted":
            self._ready.append(group)
        elif outcome == "filtered":
            self.counts["filtered"] += 1
        else:
            reason = "stopped" if self._stop.is_set() and outcome == "aborted" else outcome
            self.dropped[reason] += 1

    # hand-out (trainer thread)

    def get_batch(self, timeout: float | None = None) -> RolloutBatch:
        """The next batch_groups groups that pass the staleness check; TimeoutError if none."""
        deadline = None if timeout is None else time.monotonic() + timeout
        start = time.perf_counter()
        with self._cond:
            while True:
                version = self.client.weight_version()
                self._check_ready(version)
                if len(self._ready) >= self.batch_groups:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no batch of {self.batch_groups} groups within "
                                       f"{timeout}s ({len(self._ready)} ready)")
                if self._stop.is_set():
                    raise RuntimeError("AsyncRollout is stopped")
                self._cond.wait(0.05 if left is None else min(left, 0.05))
            groups, self._ready = self._ready[: self.batch_groups], self._ready[
                self.batch_groups:]
            self.counts["accepted"] += len(groups)
            self._handle_unfinished()
            scored, self._scored = self._scored, []
            reward_s, self._reward_s = self._reward_s, 0.0
            self._cond.notify_all()
        batch = self._to_batch(groups, version, time.perf_counter() - start)
        batch.meta["scored_rewards"], batch.meta["reward_s"] = scored, reward_s
        return batch

    def _check_ready(self, version: str) -> None:
        keep = []
        for group in self._ready:
            lags = self.client.versions.lags(
                version, [v for t in group.trajs for v in t.trainable_versions()])
            if max(lags, default=0) <= self.max_staleness:
                keep.append(group)
            elif self.stale == "mask":
                for t in group.trajs:
                    self._mask_stale(t, version)
                keep.append(group)
                self.counts["masked_groups"] += 1
            else:
                self.dropped["stale"] += 1
        self._ready = keep

    def _mask_stale(self, traj: Trajectory, version: str) -> None:
        lags = self.client.versions.lags(version, [v or version for v in traj.versions])
        for i, (v, lag) in enumerate(zip(traj.versions, lags)):
            if v is not None and lag > self.max_staleness:
                traj.loss_mask[i], traj.logprobs[i], traj.versions[i] = 0, 0.0, None

    def _handle_unfinished(self) -> None:
        for group in list(self._running.values()):
            if self.partial:
                group.carried += 1
                self.counts["carried"] += 1
                continue
            self._running.pop(group.gid)
            self.dropped["unfinished at hand-out"] += 1
            self._retry.append(group.row_index)
            group.client.abort_inflight()

    def _to_batch(self, groups: list[_Group], version: str, wait_s: float) -> RolloutBatch:
        trajs = [t for g in groups for t in g.trajs]
        advantages = grpo_advantages([t.reward for t in trajs], [t.group_id for t in trajs],
                                     self.scale)
        lags = self.client.versions.lags(version, [v for t in trajs
                                                   for v in t.trainable_versions()])
        meta = {"weight_version": version, "seconds": wait_s,
                "sampling": dict(self.client.sampling),
                "staleness": {"max_lag": max(lags, default=0),
                              "carried_groups": sum(g.carried > 0 for g in groups)},
                "accounting": self.accounting()}
        return RolloutBatch.from_trajectories(trajs, advantages, meta)

    # bookkeeping

    def accounting(self) -> dict[str, Any]:
        """started == accepted + filtered + sum(dropped) + ready + running, always."""
        with self._cond:
            return {"started": self.counts["started"], "accepted": self.counts["accepted"],
                    "filtered": self.counts["filtered"], "dropped": dict(self.dropped),
                    "carried": self.counts["carried"], "ready": len(self._ready),
                    "running": len(self._running)}
