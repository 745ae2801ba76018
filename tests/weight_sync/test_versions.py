"""The one order of weight-version labels (weight_sync/versions.py) and its users' edges: natural
order, the engine's proposal for the next label, the version a sender agrees on, and lags."""

from __future__ import annotations

import logging
import random

import pytest

from hotswap.weight_sync.sender import agreed_version
from hotswap.weight_sync.versions import (
    VersionOrder,
    newest,
    next_version,
    number_gap,
    version_key,
)

STEPS = ["0", *(f"step-{k}" for k in range(13))]


def test_digit_runs_compare_as_numbers():
    shuffled = STEPS[:]
    random.Random(0).shuffle(shuffled)
    assert sorted(shuffled, key=version_key) == STEPS  # "step-10" after "step-9", "0" first
    assert sorted(["10", "9", "100", "11"], key=version_key) == ["9", "10", "11", "100"]
    assert sorted(["v1.10", "v1.9", "v2.0", "v1.9-rc1"], key=version_key) == [
        "v1.9", "v1.9-rc1", "v1.10", "v2.0"]
    assert version_key("step-07") != version_key("step-7")  # a total order: no two labels tie
    assert newest(["step-9", "step-10", "step-2"]) == "step-10"


@pytest.mark.parametrize("label, expected", [
    ("0", "1"), ("9", "10"), ("step-3", "step-4"), ("step-9", "step-10"),
    ("ckpt-009", "ckpt-010"), ("v1.9", "v1.10"), ("v2-step-3-final", "v2-step-4-final"),
    ("main", "main-1"), ("main-1", "main-2"), ("3f9a2c", "3f9a3c")])
def test_the_proposed_next_version_orders_after_the_current(label, expected):
    assert next_version(label) == expected
    assert version_key(next_version(label)) > version_key(label)


def test_a_sender_agrees_on_the_newest_proposal():
    """The targets of a two-phase update commit on the newest version any of them proposed."""
    replies = [{"weight_version": v} for v in ("step-9", "step-10", "step-2")]
    assert agreed_version(replies) == "step-10"
    assert agreed_version([{"weight_version": v} for v in ("9", "10")]) == "10"


def test_lags_count_pushes():
    order = VersionOrder()
    # Labels that differ only in their last number: the difference, whatever was seen.
    assert order.lag("step-10", "step-7") == 3 and order.lag("10", "7") == 3
    assert order.lag("step-7", "step-10") == -3 and number_gap("a1b", "a1c") is None
    # Otherwise the versions seen in between: the engine's first "0", then the trainer's labels.
    order = VersionOrder(STEPS)
    assert order.lag("step-0", "0") == 1 and order.lag("step-11", "0") == 12
    assert order.lags("step-11", ["step-11", "step-10", "0"]) == [0, 1, 12]
    assert order.labels == STEPS


def test_a_version_that_moves_backwards_is_warned(caplog):
    order = VersionOrder()
    with caplog.at_level(logging.WARNING, logger="hotswap.weight_sync"):
        for label in ("step-8", "step-9", "step-10", "step-10"):
            order.served(label)
        assert not caplog.records
        order.served("b7e1")  # a hash after "step-10": no order to count lags in
    assert "orders before it" in caplog.text
