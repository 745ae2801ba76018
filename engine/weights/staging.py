"""A staged weight update: several update calls that commit as one version.

Trainers push weights in pieces: OpenRLHF one tensor per call, verl and slime one bucket per call
(SGLang's `flush_cache=False`), and only then say "done" (`reset_prefix_cache`, `flush_cache`).
Each piece is validated before it is written; generation is held from the first piece to the
commit, so no request ever runs on a mix of old and new tensors (DESIGN invariant 4 across the
stage). The commit bumps the version once and retires the old namespaces once. A stage abandoned
after a write leaves the weights incomplete, and the engine refuses generation until a complete
update succeeds, as for any update that failed while writing.

The stage lives in the scheduler thread: every method here runs there, between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stage:
    """What an open stage has done so far."""

    pause_mode: str
    was_paused: bool  # the user's own pause: restored, not lifted, at the end of the stage
    weight_version: str | None = None  # the version asked for by any piece (the last one wins)
    written: set[str] = field(default_factory=set)
    pieces: int = 0

    def add(self, names: list[str], weight_version: str | None) -> None:
        self.written |= set(names)
        self.pieces += 1
        if weight_version is not None:
            self.weight_version = weight_version

    def describe(self) -> str:
        return f"{self.pieces} piece(s), {len(self.written)} tensor(s)"
