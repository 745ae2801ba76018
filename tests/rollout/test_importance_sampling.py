"""Importance-sampling weights (rollout/importance.py) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hotswap.rollout.importance import importance_weights


def test_truncated_token_weights():
    # ratios e^0.5 = 1.649, e^1 = 2.718 (capped at 2), e^-1 = 0.368 (kept), masked, e^0 = 1
    trainer = torch.tensor([[0.5, 1.0, -1.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    behavior = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    iw = importance_weights(trainer, behavior, mask, cap=2.0)
    expected = torch.tensor([[math.exp(0.5), 2.0, math.exp(-1.0), 0.0], [1.0, 1.0, 0.0, 0.0]])
    torch.testing.assert_close(iw.weights, expected)
    assert iw.truncated.tolist() == [[False, True, False, False], [False] * 4]
    assert iw.truncated_share(mask) == pytest.approx(1 / 5)
    assert iw.ratio[0, 3] == 1.0  # outside the mask


def test_sequence_mask_drops_sequences_outside_the_band():
    # log ratio sums (over the mask): 0.3 + 0.2 = 0.5 (e^0.5 = 1.65 in [1/2, 2]: kept);
    # 0.4 + 0.4 = 0.8 (2.23 > 2: dropped); -0.9 (0.41 < 1/2: dropped); the masked 5.0 is ignored
    trainer = torch.tensor([[0.3, 0.2, 5.0], [0.4, 0.4, 0.0], [-0.9, 0.0, 0.0]])
    behavior = torch.zeros(3, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    iw = importance_weights(trainer, behavior, mask, cap=2.0, mode="sequence")
    assert iw.weights.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert iw.truncated.tolist() == [[False, False, False], [True, True, True],
                                     [True, False, False]]
    assert iw.truncated_share(mask) == pytest.approx(4 / 6)


def test_weights_carry_no_gradient_and_arguments_are_checked():
    trainer = torch.tensor([0.1, -0.2], requires_grad=True)
    iw = importance_weights(trainer, torch.tensor([0.0, 0.0]))
    assert not iw.weights.requires_grad
    torch.testing.assert_close(iw.weights, torch.tensor([0.1, -0.2]).exp())
    with pytest.raises(ValueError, match="cap"):
        importance_weights(trainer, trainer, cap=1.0)
    with pytest.raises(ValueError, match="mode"):
        importance_weights(trainer, trainer, mode="clip")
    with pytest.raises(ValueError, match="shape"):
        importance_weights(trainer, torch.zeros(3))
