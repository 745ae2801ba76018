"""Rewards from models: a generative judge asked for a verdict, a reward model's classify score.

Both are group rewards (rollout/rewards.py): a group's trajectories go to the scoring engine in
one call, so its engine batches them and they share the prompt's KV in its prefix cache. The
engine is any EngineClient (Engine, RemoteEngine, Router, RayFleet), normally a separate one
that the policy's weight updates never reach. Each call has a timeout and retries; when every
attempt fails, each trajectory gets `failure_reward` and a "failure" entry in its reward info
saying why, so a slow or dead scorer never hangs or breaks the rollout loop.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from hotswap.rollout.rewards import RewardFn, call_with_timeout
from hotswap.rollout.trajectory import Trajectory

# The question first: a group's judge prompts share everything up to the response.
CORRECTNESS_TEMPLATE = (
    "You grade answers to questions.\nQuestion: {question}\nReference answer: {answer}\n"
    "Response: {response}\nDoes the response give the reference answer? Reply with one word: "
    "correct or incorrect.")
CORRECTNESS = {"correct": 1.0, "incorrect": 0.0}


class Failure(Exception):
    """A scoring call that gave no usable answer: the message says why."""


def template_fields(traj: Trajectory) -> dict[str, Any]:
    """What a template may name: the row's text and number columns, `question` (the row's
    `question`, else its last user message, else its `prompt`), `answer` ("" when absent) and
    `response` (the trajectory's decoded text)."""
    row = traj.row
    fields = {k: v for k, v in row.items() if isinstance(v, (str, int, float))}
    users = [m["content"] for m in row.get("messages") or [] if m.get("role") == "user"]
    fields.setdefault("question", users[-1] if users else row.get("prompt", ""))
    fields.setdefault("answer", "")
    fields["response"] = traj.text
    return fields


class _Guarded:
    """A scoring call with a timeout per attempt and retries; on a timeout its requests are
    aborted on the engine so they stop taking its time."""

    group = True  # score_group gives it the whole group

    def __init__(self, engine: Any, timeout_s: float, retries: int, backoff_s: float,
                 failure_reward: float):
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError("timeout_s > 0, retries >= 0 and backoff_s >= 0 are required")
        self.engine, self.timeout_s, self.retries = engine, timeout_s, retries
        self.backoff_s, self.failure_reward = backoff_s, failure_reward

    @property
    def budget_s(self) -> float:
        """The longest a call of this reward takes: every attempt timing out."""
        return (self.retries + 1) * self.timeout_s + self.retries * self.backoff_s

    def attempt(self, call: Callable[[list[str]], Any], count: int) -> tuple[Any, int]:
        """call(rids)'s result and the attempts it took; Failure after the last attempt."""
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * attempt)
            rids = [f"score-{uuid.uuid4().hex}" for _ in range(count)]
            out = call_with_timeout(call, rids, self.timeout_s)
            if not (isinstance(out, dict) and "error" in out):
                return out, attempt + 1
            why = out["error"]
            if why.startswith("timeout"):
                self._abort(rids)
        raise Failure(f"{why} ({self.retries + 1} attempts)")

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            # the engine that timed out may be gone: nothing left to stop then
            with contextlib.suppress(Exception):
                self.engine.abort_request(rid=rid)

    def failed(self, why: str, seconds: float) -> dict[str, Any]:
        return {"reward": self.failure_reward, "failure": why, "score_s": seconds}


class JudgeReward(_Guarded):
    """A generative judge's verdict as the reward (see judge_reward)."""

    def __init__(self, judge: Any, template: str, verdict: Mapping[str, Any], score_field: str,
                 chat: bool, system: str | None, sampling: dict[str, Any], timeout_s: float,
                 retries: int, backoff_s: float, failure_reward: float):
        super().__init__(judge, timeout_s, retries, backoff_s, failure_reward)
        self.template, self.chat, self.system = template, chat, system
        self.score_field = score_field
        if verdict and all(isinstance(v, (int, float)) for v in verdict.values()):
            self.choices: dict[str, float] | None = {k: float(v) for k, v in verdict.items()}
            grammar: dict[str, Any] = {"choices": list(self.choices)}
        elif score_field in verdict.get("properties", {}):
            self.choices, grammar = None, {"json_schema": dict(verdict)}
        else:
            raise ValueError("verdict: {choice: score, ...} or a JSON schema whose properties "
                             f"hold {score_field!r}")
        self.sampling = {"temperature": 0.0, "max_new_tokens": 64, **sampling, **grammar}

    def __call__(self, trajs: list[Trajectory]) -> list[dict[str, Any]]:
        start = time.perf_counter()
        prompts, bad = [], {}
        for i, traj in enumerate(trajs):
            try:
                prompts.append(self.template.format_map(template_fields(traj)))
            except (KeyError, IndexError, ValueError) as exc:
                bad[i] = f"template: {type(exc).__name__}: {exc}"
        try:
            outs, attempts = (self.attempt(self._ask(prompts), len(prompts)) if prompts
                              else ([], 0))
        except Failure as exc:
            return [self.failed(str(exc), time.perf_counter() - start) for _ in trajs]
        seconds = time.perf_counter() - start
        answers = iter(outs)
        return [self.failed(bad[i], seconds) if i in bad else
                self._verdict(next(answers), attempts, seconds) for i in range(len(trajs))]

    def _ask(self, prompts: list[str]) -> Callable[[list[str]], list[dict]]:
        def call(rids: list[str]) -> list[dict]:
            if not self.chat:
                return self.engine.generate(prompt=prompts, sampling_params=self.sampling,
                                            rid=rids)
            head = [{"role": "system", "content": self.system}] if self.system else []
            chats = [[*head, {"role": "user", "content": p}] for p in prompts]
            return self.engine.generate(messages=chats, sampling_params=self.sampling, rid=rids)
        return call

    def _verdict(self, out: dict, attempts: int, seconds: float) -> dict[str, Any]:
        text = out.get("text", "")
        finish = out.get("meta_info", {}).get("finish_reason") or {}
        info = {"verdict": text, "judge_attempts": attempts, "score_s": seconds}
        if finish.get("type") == "abort":
            return {**self.failed(f"judge aborted: {finish.get('message')}", seconds), **info}
        try:
            score = self._parse(text)
        except (ValueError, KeyError, TypeError) as exc:
            return {**self.failed(f"unparsed verdict: {exc}", seconds), **info}
        return {"reward": score, **info}

    def _parse(self, text: str) -> float:
        if self.choices is not None:
            if text.strip() not in self.choices:
                raise ValueError(f"{text!r} is none of {list(self.choices)}")
            return self.choices[text.strip()]
        score = float(json.loads(text)[self.score_field])
        if not math.isfinite(score):
            raise ValueError(f"{self.score_field} is {score}")
        return score


def judge_reward(judge: Any, template: str = CORRECTNESS_TEMPLATE,
                 verdict: Mapping[str, Any] = CORRECTNESS, *, score_field: str = "score",
                 chat: bool = True, system: str | None = None,
                 sampling: dict[str, Any] | None = None, timeout_s: float = 60.0,
                 retries: int = 1, backoff_s: float = 0.5,
                 failure_reward: float = math.nan) -> RewardFn:
    """A group reward that asks `judge` (any EngineClient) about every trajectory of a group in
    one generate call.

    template: a str.format template over template_fields (question, answer, response and the
    row's columns); sent as the user message of a chat (the judge's chat template, after
    `system` when given), or as raw text with chat=False. verdict: {choice: score} forces one
    of the choices with a `choices` grammar and maps it to its score; a JSON schema (a dict
    with "properties") forces a JSON object and reads its numeric `score_field`. sampling: the
    judge's sampling parameters (temperature 0 and 64 new tokens unless given). Each call has
    timeout_s and `retries` more attempts; a failure scores `failure_reward` (NaN: advantage
    0) with info["failure"] saying why. Each trajectory's info: "verdict" (the judge's text),
    "judge_attempts", "score_s" (the group's seconds)."""
    return JudgeReward(judge, template, verdict, score_field, chat, system, dict(sampling or {}),
                       timeout_s, retries, backoff_s, failure_reward)


class ModelReward(_Guarded):
    """A reward model's classify score as the reward (see model_reward)."""

    INPUTS = ("messages", "ids", "text")

    def __init__(self, model: Any, label: int, activation: bool, input: str,
                 text_template: str, timeout_s: float, retries: int, backoff_s: float,
                 failure_reward: float):
        super().__init__(model, timeout_s, retries, backoff_s, failure_reward)
        if input not in self.INPUTS:
            raise ValueError(f"input must be one of {self.INPUTS}, got {input!r}")
        self.label, self.activation, self.input = label, activation, input
        self.text_template = text_template

    def __call__(self, trajs: list[Trajectory]) -> list[dict[str, Any]]:
        start = time.perf_counter()
        try:
            outs, _ = self.attempt(self._score(trajs), len(trajs))
        except Failure as exc:
            return [self.failed(str(exc), time.perf_counter() - start) for _ in trajs]
        seconds = time.perf_counter() - start
        results = []
        for out in outs:
            scores = out["scores"]
            if not 0 <= self.label < len(scores):
                results.append(self.failed(f"label {self.label} outside the model's "
                                           f"{len(scores)} classes", seconds))
            else:
                results.append({"reward": float(scores[self.label]), "scores": scores,
                                "score_s": seconds})
        return results

    def _score(self, trajs: list[Trajectory]) -> Callable[[list[str]], list[dict]]:
        kwargs: dict[str, Any]
        if self.input == "ids":
            kwargs = {"input_ids": [t.prompt_ids + t.response_ids for t in trajs]}
        elif self.input == "text":
            kwargs = {"prompt": [self.text_template.format_map(template_fields(t))
                                 for t in trajs]}
        else:
            kwargs = {"messages": [conversation(t) for t in trajs]}

        def call(rids: list[str]) -> list[dict]:
            return self.engine.classify(**kwargs, activation=self.activation, rid=rids)
        return call


def conversation(traj: Trajectory) -> list[dict[str, Any]]:
    """The trajectory as a chat: a multi-turn loop's own messages, else the row's prompt
    (messages, or `prompt` as one user turn) and the response as the assistant's turn."""
    if traj.messages:
        return list(traj.messages)
    row = traj.row
    chat = list(row.get("messages") or [{"role": "user", "content": row.get("prompt", "")}])
    return [*chat, {"role": "assistant", "content": traj.text}]


def model_reward(reward_model: Any, *, label: int = 0, activation: bool = False,
                 input: str = "messages", text_template: str = "{question}{response}",
                 timeout_s: float = 60.0, retries: int = 1, backoff_s: float = 0.5,
                 failure_reward: float = math.nan) -> RewardFn:
    """A group reward: `reward_model.classify` (any EngineClient serving a reward model) on
    every trajectory of a group in one call; the reward is class `label`'s score (raw, or
    after the activation: sigmoid for one class, softmax over several).

    input: "messages" (conversation(traj), in the reward model's own chat template), "ids"
    (the trajectory's prompt + response ids as they are: the reward model must share the
    policy's tokenizer) or "text" (text_template over template_fields). Timeouts, retries and
    failures as judge_reward's; each trajectory's info: "scores" (every class), "score_s"."""
    return ModelReward(reward_model, label, activation, input, text_template, timeout_s,
                       retries, backoff_s, failure_reward)


class Combined:
    """The sum of model rewards (judge_reward, model_reward), each kept in the info under its
    name; the task's own reward, when given, is computed too and kept as "task_reward" (it
    does not count)."""

    group = True

    def __init__(self, scorers: dict[str, RewardFn], task_reward: RewardFn | None = None):
        if not scorers:
            raise ValueError("scorers: at least one")
        self.scorers, self.task_reward = scorers, task_reward

    @property
    def budget_s(self) -> float:
        return sum(getattr(s, "budget_s", 0.0) for s in self.scorers.values())

    def __call__(self, trajs: list[Trajectory]) -> list[dict[str, Any]]:
        infos: list[dict[str, Any]] = [{"reward": 0.0} for _ in trajs]
        for name, scorer in self.scorers.items():
            for info, part in zip(infos, scorer(trajs)):
                failure = part.pop("failure", None)
                if failure is not None:
                    info["failure"] = f"{name}: {failure}"
                info.update(part, reward=info["reward"] + part["reward"], **{name: part["reward"]})
        if self.task_reward is not None:
            for info, traj in zip(infos, trajs):
                own = self.task_reward(traj)
                own = own.get("reward", math.nan) if isinstance(own, dict) else own
                info["task_reward"] = math.nan if own is None else float(own)
        return infos
