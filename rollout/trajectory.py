"""Trajectory (one sample of one prompt) and RolloutBatch (what a trainer consumes).

Invariants kept here: response_ids, loss_mask, logprobs and versions have one entry per response
token; a token with loss mask 0 (template, tool output) has logprob 0 and no version; the
trajectories of a group are adjacent in a batch. Routed experts (MoE routing replay) have one row
per position of prompt + response that the engine fed, in sequence order (docs/moe.md).
With images (vision-language models) the ids are the engine's expanded ones (one placeholder
run per image, as long as its grid says) and `images` holds the images in sequence order, one
per run, with the engine's `image_meta` for each (grid_thw, hash, offset, tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hotswap.weight_sync.versions import VersionOrder


def extend_routes(kept: np.ndarray | None, routes: np.ndarray | None) -> np.ndarray | None:
    """Routes of a longer request over the same tokens: the positions already recorded keep
    the routing that produced their next token; only those past them are taken from `routes`."""
    if kept is None or routes is None:
        return routes if kept is None else kept
    return np.concatenate([kept, routes[len(kept):]])


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)
    finish_reason: str = "length"
    reward: float = math.nan
    reward_info: dict[str, Any] = field(default_factory=dict)
    group_id: int = 0
    sample_idx: int = 0
    num_turns: int = 1
    tool_calls: int = 0  # multi-turn loops: calls parsed and run
    parse_errors: int = 0  # calls that did not parse (the model got an error message)
    row: dict[str, Any] = field(default_factory=dict)
    text: str = ""  # the decoded response (the model's final answer for rewards to read)
    messages: list[dict[str, Any]] = field(default_factory=list)  # multi-turn loops: the chat
    # [positions, moe_layers, top_k]: the engine's experts for prompt + response (routing replay)
    routed_experts: np.ndarray | None = None
    images: list[Any] = field(default_factory=list)  # every image of prompt + response, in order
    image_meta: list[dict[str, Any]] = field(default_factory=list)  # the engine's, per image

    def append_generated(self, ids: list[int], logprobs: list[float],
                         versions: list[str | None], routes: np.ndarray | None = None) -> None:
        """The model's own tokens: trainable (mask 1) with their behaviour logprob and version;
        `routes`: the request's routed experts (its prompt is this trajectory so far)."""
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        self.routed_experts = extend_routes(self.routed_experts, routes)

    def append_context(self, ids: list[int]) -> None:
        """Template or tool tokens: part of the sequence, never trained on."""
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [None] * len(ids)

    def adopt_expanded(self, ids: list[int] | None, image_meta: list[dict[str, Any]]) -> None:
        """Take the engine's expanded ids of prompt + response so far (meta_info["prompt_ids"]
        of the request that continued it) and its image meta. Only the placeholders of images
        added since the last request grow, and those sit in the trailing context tokens (a tool
        message), so the response's last context run is replaced by the engine's."""
        if ids is None:
            return
        if not self.response_ids:
            self.prompt_ids = list(ids)
        else:
            keep = len(self.response_ids)
            while keep and self.loss_mask[keep - 1] == 0:
                keep -= 1
            start = len(self.prompt_ids) + keep
            if list(ids[:start]) != self.prompt_ids + self.response_ids[:keep]:
                raise ValueError("the engine's prompt ids differ from the trajectory's before "
                                 "its last context tokens")
            self.response_ids = self.response_ids[:keep]
            del self.loss_mask[keep:], self.logprobs[keep:], self.versions[keep:]
            self.append_context(list(ids[start:]))
        self.image_meta = list(image_meta)

    def check(self) -> None:
        n = len(self.response_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise AssertionError("trajectory: per-token lists differ in length")
        for m, lp, v in zip(self.loss_mask, self.logprobs, self.versions):
            if m == 0 and (lp != 0.0 or v is not None):
                raise AssertionError("trajectory: a masked token carries a logprob or version")

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)

    def trainable_versions(self) -> list[str]:
        return [v for m, v in zip(self.loss_mask, self.versions) if m and v is not None]


@dataclass
class RolloutBatch:
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    loss_mask: list[list[int]]
    behavior_logprobs: list[list[float]]
    weight_versions: list[list[str | None]]
    rewards: list[float]
    advantages: list[float]
    reward_info: list[dict[str, Any]]
    group_ids: list[int]
    sample_idx: list[int]
    finish_reason: list[str]
    num_turns: list[int]
    meta: dict[str, Any] = field(default_factory=dict)
    trajectories: list[Trajectory] = field(default_factory=list, repr=False)
    routed_experts: list[np.ndarray | None] = field(default_factory=list, repr=False)
    images: list[list[Any]] = field(default_factory=list, repr=False)  # per row, in order
    image_meta: list[list[dict[str, Any]]] = field(default_factory=list, repr=False)

    @classmethod
    def from_trajectories(cls, trajs: list[Trajectory], advantages: list[float],
                          meta: dict[str, Any] | None = None) -> RolloutBatch:
        """Groups are made adjacent (stable order of first appearance)."""
        order = {g: i for i, g in reversed(list(enumerate(t.group_id for t in trajs)))}
        trajs = sorted(zip(trajs, advantages), key=lambda ta: (order[ta[0].group_id],
                                                               ta[0].sample_idx))
        ts = [t for t, _ in trajs]
        for t in ts:
            t.check()
        return cls(
            prompt_ids=[list(t.prompt_ids) for t in ts],
            response_ids=[list(t.response_ids) for t in ts],
            loss_mask=[list(t.loss_mask) for t in ts],
            behavior_logprobs=[list(t.logprobs) for t in ts],
            weight_versions=[list(t.versions) for t in ts],
            rewards=[t.reward for t in ts], advantages=[float(a) for _, a in trajs],
            reward_info=[dict(t.reward_info) for t in ts], group_ids=[t.group_id for t in ts],
            sample_idx=[t.sample_idx for t in ts], finish_reason=[t.finish_reason for t in ts],
            num_turns=[t.num_turns for t in ts], meta=dict(meta or {}), trajectories=ts,
            routed_experts=[t.routed_experts for t in ts], images=[list(t.images) for t in ts],
            image_meta=[list(t.image_meta) for t in ts])

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_groups(self) -> int:
        return len(set(self.group_ids))

    def to_tensors(self, pad_id: int) -> dict[str, torch.Tensor]:
        """Prompts left-padded, responses right-padded; `attention_mask` covers [prompt|response].

        `weight_versions` become how many versions each is after the batch's oldest (its lag,
        weight_sync/versions.py: "step-9", "step-10" -> 0, 1), -1 where no version (masked or
        padding). With routed experts: `routed_experts` [rows, prompt + response columns,
        moe_layers, top_k], aligned with [prompt|response], -1 where none was recorded
        (padding, the last token), as replay_routes takes them.
        """
        n = len(self)
        p_len = max((len(p) for p in self.prompt_ids), default=0)
        r_len = max((len(r) for r in self.response_ids), default=0)
        prompt = torch.full((n, p_len), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
        resp = torch.full((n, r_len), pad_id, dtype=torch.long)
        resp_mask = torch.zeros((n, r_len), dtype=torch.long)
        loss = torch.zeros((n, r_len), dtype=torch.float32)
        logp = torch.zeros((n, r_len), dtype=torch.float32)
        vers = torch.full((n, r_len), -1, dtype=torch.long)
        codes = _version_codes([v for row in self.weight_versions for v in row
                                if v is not None])
        for i in range(n):
            p, r = self.prompt_ids[i], self.response_ids[i]
            if p:
                prompt[i, p_len - len(p):] = torch.tensor(p)
                prompt_mask[i, p_len - len(p):] = 1
            if r:
                resp[i, :len(r)] = torch.tensor(r)
                resp_mask[i, :len(r)] = 1
                loss[i, :len(r)] = torch.tensor(self.loss_mask[i], dtype=torch.float32)
                logp[i, :len(r)] = torch.tensor(self.behavior_logprobs[i])
                vers[i, :len(r)] = torch.tensor([codes.get(v, -1) for v in
                                                 self.weight_versions[i]])
        out = {
            "prompt_ids": prompt, "response_ids": resp, "loss_mask": loss,
            "behavior_logprobs": logp, "weight_versions": vers,
            "attention_mask": torch.cat([prompt_mask, resp_mask], dim=1),
            "rewards": torch.tensor(self.rewards, dtype=torch.float32),
            "advantages": torch.tensor(self.advantages, dtype=torch.float32),
            "group_ids": torch.tensor(self.group_ids, dtype=torch.long),
            "sample_idx": torch.tensor(self.sample_idx, dtype=torch.long),
            "num_turns": torch.tensor(self.num_turns, dtype=torch.long),
        }
        if any(r is not None for r in self.routed_experts):
            out["routed_experts"] = self._routes_tensor(p_len, r_len)
        return out

    def _routes_tensor(self, p_len: int, r_len: int) -> torch.Tensor:
        shape = next(r.shape[1:] for r in self.routed_experts if r is not None)
        routes = torch.full((len(self), p_len + r_len, *shape), -1, dtype=torch.int16)
        for i, r in enumerate(self.routed_experts):
            if r is None:
                continue
            start = p_len - len(self.prompt_ids[i])  # the row's first token's column
            count = min(len(r), p_len + r_len - start)
            routes[i, start: start + count] = torch.from_numpy(np.asarray(r[:count],
                                                                          dtype=np.int16))
        return routes


def _version_codes(labels: list[str]) -> dict[str | None, int]:
    """Each version's lag behind the oldest of `labels`."""
    order = VersionOrder(labels)
    distinct = order.labels
    return {v: order.lag(v, distinct[0]) for v in distinct} if distinct else {}
