"""The draft length of each step, chosen by measurement.

Whether speculation pays depends on the machine, the model, the batch and the workload: at batch
1 a forward over a few more tokens costs about what one token costs (the weights are read once),
at batch 64 about what the extra tokens cost, and the drafts of unpredictable text are rarely
kept. So nothing here is a fixed switch. Per bucket of decode batch size, lengths are compared
in duels: the best length so far and a challenger take turns, step by step, until each has run
a few steps and emitted enough tokens to tell them apart, and each is scored by the tokens its
steps emitted over the seconds they took (drafting, the forward and sampling included).
Interleaving makes both sides see the same machine and the same stretch of the workload.
Exploration starts at 0 (no speculation) and tries the next longer length only while
challengers win; later, the best length's neighbours challenge it again, less and less often
while they keep losing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CANDIDATES = (0, 1, 2, 4, 8, 16)  # doubling: neighbours differ enough for a duel to tell
# Each side of a duel runs at least PROBE_STEPS steps and emits at least PROBE_TOKENS tokens:
# at batch 1 a step emits 1 to length + 1 tokens at random, and it takes ~100 tokens to tell
# lengths apart; at batch 64 a few steps average over many rows (and cost the most to probe).
PROBE_STEPS = 4
PROBE_TOKENS = 128
MARGIN = 1.03  # a challenger must be this much faster to take over (ties: the shorter length)
# Steps between duels once exploration ended, per row of the bucket's batch size (a probe of a
# longer draft costs more at a larger batch); doubles after each round the best length keeps.
REDUEL_STEPS_PER_ROW = 32
MIN_REDUEL_STEPS = 64
MAX_REDUEL_DOUBLINGS = 5


def bucket(batch: int) -> int:
    """1, 2, 4, 8, ... : the power of two at or above the decode batch size."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass
class _Bucket:
    best: int = 0
    challengers: list[int] = field(default_factory=list)  # pending, in order
    exploring: bool = True  # challengers are the next longer lengths, one at a time
    window: dict[int, list[float]] = field(default_factory=dict)  # length -> [steps, tok, s]
    rates: dict[int, float] = field(default_factory=dict)  # last measured tokens/s by length
    turn: int = 0
    round_won: bool = False
    idle: int = 0  # steps since the last duel ended
    reduel: int = 0  # steps to wait before the next round (set when a round ends)
    base: int = MIN_REDUEL_STEPS


class DraftLengths:
    def __init__(self, max_length: int):
        self.candidates = [d for d in CANDIDATES if d < max_length] + [max_length]
        self.buckets: dict[int, _Bucket] = {}

    def choose(self, batch: int) -> int:
        b = self.buckets.get(bucket(batch))
        if b is None:
            size = bucket(batch)
            base = max(MIN_REDUEL_STEPS, REDUEL_STEPS_PER_ROW * size)
            b = self.buckets[size] = _Bucket(challengers=self.candidates[1:2], base=base)
        if not b.challengers:
            b.idle += 1
            if b.idle < b.reduel:
                return b.best
            i = self.candidates.index(b.best)
            b.challengers = [self.candidates[j] for j in (i + 1, i - 1)
                             if 0 <= j < len(self.candidates)]
        b.turn += 1
        return b.challengers[0] if b.turn % 2 else b.best

    def record(self, batch: int, length: int, tokens: int, seconds: float) -> None:
        """A decode-only step of `batch` rows at draft length `length` emitted `tokens`."""
        b = self.buckets.get(bucket(batch))
        if b is None or seconds <= 0 or not b.challengers:
            return
        challenger = b.challengers[0]
        if length not in (b.best, challenger):
            return
        window = b.window.setdefault(length, [0, 0, 0.0])
        window[0] += 1
        window[1] += tokens
        window[2] += seconds
        sides = [b.window.get(d, [0, 0, 0.0]) for d in (b.best, challenger)]
        if any(steps < PROBE_STEPS or tok < PROBE_TOKENS for steps, tok, _ in sides):
            return
        for d in (b.best, challenger):
            steps, tok, secs = b.window.pop(d)
            b.rates[d] = tok / secs
        won = b.rates[challenger] > MARGIN * b.rates[b.best]
        b.challengers.pop(0)
        b.turn = 0
        if won:
            b.best = challenger
            b.round_won = True
        if b.exploring:
            i = self.candidates.index(challenger) + 1
            if won and i < len(self.candidates):
                b.challengers = [self.candidates[i]]
                return
            b.exploring = False
        elif won:  # a new best: its own neighbours challenge it in the next round
            b.challengers = []
        if not b.challengers:  # the round is over
            b.idle = 0
            longest = b.base << MAX_REDUEL_DOUBLINGS
            b.reduel = b.base if b.round_won or not b.reduel else min(2 * b.reduel, longest)
            b.round_won = False

    def best(self, batch: int) -> int:
        return self.buckets[bucket(batch)].best

    def table(self) -> dict[int, dict[str, object]]:
        """Per bucket: the best length and the last measured tokens/s by length (any thread:
        copies of the dicts, which the scheduler thread may grow meanwhile)."""
        return {k: {"best": b.best,
                    **{str(d): round(r, 1) for d, r in sorted(list(b.rates.items()))}}
                for k, b in sorted(list(self.buckets.items()))}
