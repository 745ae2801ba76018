"""N-gram drafts (prompt lookup): the continuation of the latest earlier occurrence of the
request's last n tokens, copied from its own prompt and output. No model runs."""

from __future__ import annotations

MIN_N = 2  # shorter suffixes match almost anywhere and are rarely continued the same way
MAX_N = 4


class NgramIndex:
    """Where each n-gram (MIN_N <= n <= MAX_N) of one request's tokens last ended, kept up to
    date as the tokens grow (a request's tokens only ever grow: prompt + output)."""

    def __init__(self) -> None:
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in last_end

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix of `tokens` seen before."""
        # n-grams that end before the last token: the suffix itself never matches itself
        for end in range(self.indexed + 1, len(tokens)):
            for n in range(MIN_N, min(MAX_N, end) + 1):
                self.last_end[tuple(tokens[end - n: end])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)
        if limit <= 0:
            return []
        for n in range(min(MAX_N, len(tokens)), MIN_N - 1, -1):
            end = self.last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end: end + limit]
        return []
