"""The accept rules of a verify step.

Point-mass drafts (n-grams, self-drafts, and a learned draft's argmax for greedy, seeded and
truncated rows) propose one token per position. At verify position j the target's sampler draws
y_j from exactly the distribution a plain decode step would use there (the same logit
processing, with penalties over output + draft[:j], and the seeded uniform of step
len(output) + j), given that drafts 0..j-1 are kept. Draft x_j is kept iff y_j == x_j; the
first mismatch emits y_j itself, and when every draft is kept the last position's draw is a
bonus token.

This is the standard rule (accept with probability min(1, p(x) / q(x)), else draw from the
residual max(0, p - q) renormalised) for q = delta(x): accept with probability p(x), and on a
rejection draw from p restricted to tokens other than x. Here P(y_j == x_j) = p(x_j), and given
y_j != x_j, y_j follows p conditioned on being not x_j: the same law, so every emitted token is
distributed as without speculation. Greedy rows emit the argmax at every position, token for
token what plain decoding emits; seeded rows use the same uniforms as plain decoding, so they
emit the same tokens too (up to the float rounding of a wider forward).

Sampled drafts (a learned draft's rows sampled over the whole vocabulary without a seed) are
drawn from the draft's own distribution q, and the sampler's `check_sampled`
(executor/sampling.py) applies the standard rule as it
is: keep x_j with probability min(1, p(x_j) / q(x_j)), else emit a draw from max(0, p - q)
renormalised. For any q, P(emit t) = min(p(t), q(t)) + (1 - sum_v min(p(v), q(v))) *
max(0, p(t) - q(t)) / sum_v max(0, p(v) - q(v)) = p(t), since both sums equal the total
variation distance; the expected acceptance is sum_v min(p(v), q(v)), which a q close to p
brings near 1 at temperature 1, where a point mass keeps only p(x).
"""

from __future__ import annotations


def accepted_length(draft: list[int], draws: list[int]) -> int:
    """How many leading drafts the target's draws keep (`draws` has len(draft) + 1 entries);
    the row then emits draws[: accepted + 1]."""
    kept = 0
    while kept < len(draft) and draws[kept] == draft[kept]:
        kept += 1
    return kept
