"""verl's custom reward function for examples/verl/addition_data.py:
`reward.custom_reward_function.path=examples/verl/reward.py` (name: compute_score)."""

from __future__ import annotations

import re
from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: Any = None, **kwargs: Any) -> float:
    """1.0 when the last number of the reply is the sum, else 0.0."""
    numbers = re.findall(r"-?\d+", solution_str)
    return float(bool(numbers) and numbers[-1] == str(ground_truth))
