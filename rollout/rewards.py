"""Rewards: per-sample or per-group, sync or async, with a timeout; built-in verifiable rewards.

A reward is `fn(traj) -> float | dict | None`, or, marked with `@group_reward`,
`fn(list[Trajectory]) -> list`. A dict fills `reward_info`; its "reward" key (else the sum of its
numeric values, weighted by `fn.weights` when set) is the reward. A timeout, an exception or None
scores NaN, which `grpo_advantages` turns into advantage 0. A reward with its own timeouts (the
judges of rollout/judges.py) says how long it can take in `fn.budget_s`; score_group waits that
long when it is longer than its own timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from hotswap.rollout.trajectory import Trajectory

RewardFn = Callable[..., Any]


def group_reward(fn: RewardFn) -> RewardFn:
    """Mark `fn` as scoring a whole group: fn(list[Trajectory]) -> list of rewards."""
    fn.group = True  # type: ignore[attr-defined]
    return fn


def score_group(trajs: list[Trajectory], reward: RewardFn | None,
                timeout_s: float | None = 30.0) -> float:
    """Fill `reward` and `reward_info` of every trajectory of one group, in place; returns the
    seconds it took."""
    if reward is None:
        return 0.0
    start = time.perf_counter()
    budget = getattr(reward, "budget_s", None)
    if timeout_s is not None and budget is not None:
        timeout_s = max(timeout_s, budget + 1.0)  # a second for the reward's own bookkeeping
    if getattr(reward, "group", False):
        results = call_with_timeout(reward, trajs, timeout_s)
        if not isinstance(results, (list, tuple)) or len(results) != len(trajs):
            results = [results if isinstance(results, dict) and "error" in results else None
                       ] * len(trajs)
    else:
        results = [call_with_timeout(reward, t, timeout_s) for t in trajs]
    for traj, result in zip(trajs, results):
        traj.reward, traj.reward_info = _to_reward(result, getattr(reward, "weights", None))
    return time.perf_counter() - start


def call_with_timeout(fn: RewardFn, arg: Any, timeout_s: float | None) -> Any:
    """fn(arg) (a coroutine function too) run in its own thread, giving up after timeout_s:
    its result, or {"error": why} after an exception or the timeout."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            out = fn(arg)
            box["out"] = asyncio.run(out) if inspect.isawaitable(out) else out
        except Exception as exc:  # a broken reward scores NaN; rollouts go on
            box["out"] = {"error": f"{type(exc).__name__}: {exc}"}

    worker = threading.Thread(target=run, daemon=True, name="reward")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return {"error": f"timeout after {timeout_s}s"}
    return box.get("out")


def _to_reward(result: Any, weights: dict[str, float] | None) -> tuple[float, dict[str, Any]]:
    if result is None:
        return math.nan, {}
    if isinstance(result, dict):
        info = dict(result)
        if "error" in info:
            return math.nan, info
        if "reward" in info:
            return float(info["reward"]), info
        nums = {k: float(v) for k, v in info.items() if isinstance(v, (int, float))}
        w = weights or {}
        return sum(v * w.get(k, 1.0) for k, v in nums.items()), info
    value = float(result)
    return value, {}


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def parse_final_answer(text: str) -> str | None:
    """The final answer in `text`: \\boxed{x}, '#### x', 'answer: x', else the last number."""
    for pattern in (r"\\boxed\{([^{}]*)\}", r"####\s*(.+)", r"(?i)answer\s*(?:is|:)\s*(.+)"):
        hits = re.findall(pattern, text)
        if hits:
            return _normalize(hits[-1])
    numbers = re.findall(_NUMBER, text)
    return _normalize(numbers[-1]) if numbers else None


def _normalize(answer: str) -> str:
    answer = answer.strip().strip(".").strip().replace(",", "")
    return answer.lower()


def exact_match(answer_key: str = "answer", parse: Callable[[str], str | None] | None = None
                ) -> RewardFn:
    """1.0 when the parsed final answer equals row[answer_key] (normalised), else 0.0."""
    parse = parse or parse_final_answer

    def reward(traj: Trajectory) -> dict:
        got = parse(traj.text)
        want = _normalize(str(traj.row[answer_key]))
        return {"reward": float(got is not None and got == want), "parsed": got}

    return reward


def json_schema_valid(schema: dict | str) -> RewardFn:
    """1.0 when the response text is JSON valid under `schema` (type, properties, required,
    enum, items, min/max), else 0.0."""
    schema = json.loads(schema) if isinstance(schema, str) else schema

    def reward(traj: Trajectory) -> float:
        try:
            value = json.loads(traj.text)
        except ValueError:
            return 0.0
        return float(_valid(value, schema))

    return reward


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
          "integer": int, "number": (int, float)}


def _valid(value: Any, schema: dict) -> bool:
    kind = schema.get("type")
    if kind is not None:
        if isinstance(value, bool) and kind in ("integer", "number"):
            return False
        if not isinstance(value, _TYPES[kind]):
            return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (
            value < schema.get("minimum", -math.inf) or value > schema.get("maximum", math.inf)):
        return False
    if isinstance(value, dict):
        if any(k not in value for k in schema.get("required", [])):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(_valid(value[k], s) for k, s in props.items() if k in value)
    if isinstance(value, list) and "items" in schema:
        return all(_valid(v, schema["items"]) for v in value)
    return True


def length_penalty(max_tokens: int, coef: float = 1.0) -> RewardFn:
    """-coef x the fraction of `max_tokens` the trainable response tokens used."""
    return lambda traj: -coef * traj.num_trainable / max_tokens


def format_match(pattern: str) -> RewardFn:
    """1.0 when the response text matches `pattern` (re.search), else 0.0."""
    regex = re.compile(pattern)
    return lambda traj: float(regex.search(traj.text) is not None)
