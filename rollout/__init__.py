"""hotswap.rollout: prompts -> groups of trajectories with logprobs, versions and loss masks."""

from __future__ import annotations

from hotswap.rollout.advantages import grpo_advantages, nonzero_std
from hotswap.rollout.agent_loops import SingleTurn
from hotswap.rollout.async_rollout import AsyncRollout
from hotswap.rollout.client import Completion, TokenClient
from hotswap.rollout.collect import collect
from hotswap.rollout.exact_forward import ExactForward
from hotswap.rollout.judges import judge_reward, model_reward
from hotswap.rollout.program import assistant, function, gen, select, system, user
from hotswap.rollout.rewards import (
    exact_match,
    format_match,
    group_reward,
    json_schema_valid,
    length_penalty,
    parse_final_answer,
)
from hotswap.rollout.tool_loop import ToolLoop, hermes_tool_calls
from hotswap.rollout.trajectory import RolloutBatch, Trajectory

__all__ = [
    "AsyncRollout", "Completion", "ExactForward", "RolloutBatch", "SingleTurn", "TokenClient",
    "ToolLoop", "Trajectory", "collect", "hermes_tool_calls",
    "exact_match", "format_match", "grpo_advantages", "group_reward", "json_schema_valid",
    "length_penalty", "nonzero_std", "parse_final_answer", "assistant", "function", "gen",
    "select", "system", "user", "judge_reward", "model_reward",
]
