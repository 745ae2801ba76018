"""Trajectory / RolloutBatch / advantages / rewards, checked by hand (no engine)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from hotswap.rollout import (
    RolloutBatch,
    Trajectory,
    exact_match,
    group_reward,
    grpo_advantages,
    json_schema_valid,
    nonzero_std,
    parse_final_answer,
)
from hotswap.rollout.rewards import score_group


def traj(group: int, idx: int, reward: float = math.nan, tool: bool = False) -> Trajectory:
    t = Trajectory(prompt_ids=[5] * (group + 1), group_id=group, sample_idx=idx)
    t.append_generated([10 + idx, 11], [-0.5, -0.25], ["0", "1"])
    if tool:
        t.append_context([7, 7, 7])
        t.append_generated([12], [-1.0], ["1"])
    t.reward = reward
    return t


def test_grpo_advantages_by_hand():
    rewards = [1.0, 0.0, 1.0, 0.0, 2.0, 2.0]
    groups = [0, 0, 0, 0, 1, 1]
    adv = grpo_advantages(rewards, groups)
    # group 0: mean 0.5, population std 0.5 -> +-1; group 1: all equal -> 0
    assert adv == pytest.approx([1, -1, 1, -1, 0, 0], abs=1e-5)
    assert grpo_advantages(rewards, groups, scale="none") == pytest.approx(
        [0.5, -0.5, 0.5, -0.5, 0, 0])
    batch_std = torch.tensor(rewards).std(unbiased=False).item()
    assert grpo_advantages(rewards, groups, scale="batch") == pytest.approx(
        [0.5 / batch_std, -0.5 / batch_std, 0.5 / batch_std, -0.5 / batch_std, 0, 0], rel=1e-5)
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(rewards, groups, scale="token")


def test_nan_reward_gets_zero_advantage_and_is_left_out_of_its_group():
    adv = grpo_advantages([1.0, math.nan, 0.0], [3, 3, 3])
    assert adv == pytest.approx([1.0, 0.0, -1.0], abs=1e-5)


def test_batch_masks_groups_adjacent_and_tensors():
    trajs = [traj(1, 0, 1.0), traj(0, 0, 0.0, tool=True), traj(1, 1, 0.0), traj(0, 1, 1.0)]
    adv = grpo_advantages([t.reward for t in trajs], [t.group_id for t in trajs])
    batch = RolloutBatch.from_trajectories(trajs, adv)
    assert batch.group_ids == [1, 1, 0, 0]  # first-appearance order, groups adjacent
    assert batch.sample_idx == [0, 1, 0, 1]
    assert batch.advantages == pytest.approx([1, -1, -1, 1], abs=1e-5)
    tool_row = batch.group_ids.index(0)
    assert batch.response_ids[tool_row] == [10, 11, 7, 7, 7, 12]
    assert batch.loss_mask[tool_row] == [1, 1, 0, 0, 0, 1]
    assert batch.behavior_logprobs[tool_row] == [-0.5, -0.25, 0, 0, 0, -1.0]
    assert batch.weight_versions[tool_row] == ["0", "1", None, None, None, "1"]

    t = batch.to_tensors(pad_id=99)
    # prompts left-padded to 2, responses right-padded to 6
    assert t["prompt_ids"].tolist() == [[5, 5], [5, 5], [99, 5], [99, 5]]
    assert t["response_ids"][0].tolist() == [10, 11, 99, 99, 99, 99]
    assert t["response_ids"][2].tolist() == [10, 11, 7, 7, 7, 12]
    assert t["loss_mask"][2].tolist() == [1, 1, 0, 0, 0, 1]
    assert t["loss_mask"][0].tolist() == [1, 1, 0, 0, 0, 0]
    assert t["attention_mask"].tolist()[2] == [0, 1, 1, 1, 1, 1, 1, 1]
    assert t["attention_mask"].tolist()[0] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert t["weight_versions"][2].tolist() == [0, 1, -1, -1, -1, 1]
    assert t["behavior_logprobs"][2].tolist() == [-0.5, -0.25, 0, 0, 0, -1.0]
    assert t["advantages"].tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)


def test_step_labels_order_tensors_and_staleness_metrics():
    """The README's labels: "step-10" is newer than "step-9" in the tensors and the metrics,
    and the engine's first "0" is older than both."""
    from hotswap.rollout.tracking import batch_metrics

    trajs = []
    for i, versions in enumerate([["step-10", "step-10"], ["step-9", "step-10"], ["0", "0"]]):
        t = Trajectory(prompt_ids=[5], group_id=i)
        t.append_generated([10, 11], [-0.5, -0.25], versions)
        trajs.append(t)
    batch = RolloutBatch.from_trajectories(trajs, [0.0] * 3)
    assert batch.to_tensors(pad_id=0)["weight_versions"].tolist() == [[2, 2], [1, 2], [0, 0]]
    metrics = batch_metrics(batch, "step-11")
    # lags behind step-11: 1, 1, 2, 1 by their numbers; "0" 3: step-9, step-10, step-11 after it
    assert metrics["staleness/version_lag_max"] == 3
    assert metrics["staleness/version_lag_mean"] == pytest.approx((1 + 1 + 2 + 1 + 3 + 3) / 6)


def test_masked_token_with_a_logprob_is_refused():
    t = traj(0, 0)
    t.loss_mask[0] = 0
    with pytest.raises(AssertionError, match="masked"):
        RolloutBatch.from_trajectories([t], [0.0])


def test_nonzero_std_filter():
    keep = nonzero_std()
    assert keep([traj(0, 0, 1.0), traj(0, 1, 0.0)])
    assert not keep([traj(0, 0, 1.0), traj(0, 1, 1.0)])
    assert not keep([traj(0, 0, 1.0), traj(0, 1, math.nan)])


def test_final_answer_parsing_and_exact_match():
    assert parse_final_answer("so 3 + 4 = 7.") == "7"
    assert parse_final_answer("The answer is 1,024.") == "1024"
    assert parse_final_answer("x \\boxed{42} then 5") == "42"
    assert parse_final_answer("no digits") is None
    reward = exact_match()
    good = Trajectory(prompt_ids=[1], row={"answer": 12}, text="7 + 5 = 12")
    bad = Trajectory(prompt_ids=[1], row={"answer": 12}, text="7 + 5 = 13")
    score_group([good, bad], reward)
    assert (good.reward, bad.reward) == (1.0, 0.0)
    assert good.reward_info["parsed"] == "12"


def test_json_schema_reward():
    reward = json_schema_valid({"type": "object", "required": ["n"],
                                "properties": {"n": {"type": "integer", "minimum": 0}}})
    texts = ['{"n": 3}', '{"n": -1}', '{"m": 1}', "not json", '{"n": true}']
    trajs = [Trajectory(prompt_ids=[1], text=x) for x in texts]
    score_group(trajs, reward)
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_async_group_dict_timeout_and_error_rewards():
    @group_reward
    async def by_rank(group):
        await asyncio.sleep(0)
        return [{"correct": 1.0, "short": 0.5 * i} for i in range(len(group))]

    group = [Trajectory(prompt_ids=[1], sample_idx=i) for i in range(3)]
    score_group(group, by_rank)
    assert [t.reward for t in group] == [1.0, 1.5, 2.0]  # sum of the dict's numbers
    assert group[1].reward_info == {"correct": 1.0, "short": 0.5}
    by_rank.weights = {"short": 0.0}
    score_group(group, by_rank)
    assert [t.reward for t in group] == [1.0, 1.0, 1.0]

    def slow(t):
        time.sleep(2)
        return 1.0

    def broken(t):
        raise KeyError("answer")

    for fn in (slow, broken, lambda t: None):
        one = [Trajectory(prompt_ids=[1])]
        started = time.perf_counter()
        score_group(one, fn, timeout_s=0.2)
        assert math.isnan(one[0].reward)
        assert time.perf_counter() - started < 1.5
    one = [Trajectory(prompt_ids=[1])]
    score_group(one, broken)
    assert "KeyError" in one[0].reward_info["error"]


def test_routed_experts_line_up_with_prompt_and_response_columns():
    """Routes have one row per fed position; to_tensors puts row q of a sequence under its q-th
    token (prompts left-padded) and -1 where nothing was recorded. A longer request over the
    same tokens (a resubmission, the next turn) only adds the positions past those recorded."""
    import numpy as np

    def routes(start: int, count: int) -> np.ndarray:
        return np.arange(start, start + 2 * count, dtype=np.int16).reshape(count, 1, 2)

    a = Trajectory(prompt_ids=[5, 6, 7], group_id=0)
    a.append_generated([10, 11], [-0.5, -0.5], ["0", "0"], routes(0, 4))  # 3 + 2 - 1 rows
    a.append_generated([12], [-0.5], ["1"], routes(100, 5))  # the resubmission's last row only
    b = Trajectory(prompt_ids=[5], group_id=1)
    b.append_generated([20], [-0.5], ["0"])  # no routes asked for
    batch = RolloutBatch.from_trajectories([a, b], [0.0, 0.0])
    t = batch.to_tensors(pad_id=0)
    r = t["routed_experts"]
    assert r.shape == (2, 3 + 3, 1, 2) and r.dtype == torch.int16
    assert r[0, :, 0, 0].tolist() == [0, 2, 4, 6, 108, -1]  # the last token was never fed
    assert (r[1] == -1).all()
    assert "routed_experts" not in RolloutBatch.from_trajectories([b], [0.0]).to_tensors(0)
