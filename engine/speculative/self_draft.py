"""Self-drafts: the policy's own first K decoder layers, its final norm and its head.

The draft shares every weight with the policy, so a weight update updates it too: it can never
be stale. It shares the KV cache as well: its layers are the policy's layers 0..K-1, whose KV the
policy computes for every verified token, so the draft attends to exactly what the policy wrote;
the draft's own KV for drafted positions (layers below K, in the slots the verify step then
fills) is overwritten by the verify forward. K is the user's (speculative_self_layers) or picked
once by `calibrate` from the first running requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.core.request import Req
from hotswap.engine.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 128  # per request, at most 4 requests
CALIBRATION_DRAFT = 4  # the draft length the choice of K is scored at


def expected_tokens(accept: float, length: int) -> float:
    """Tokens a verify step emits when each draft is kept with probability `accept`."""
    return float(length + 1) if accept >= 1 else (1 - accept ** (length + 1)) / (1 - accept)


class SelfDraft:
    def __init__(self, runner: ModelRunner, layers: int | None,
                 prepare_lora: Callable[[list[str | None], list[int]], Any]):
        self.runner = runner
        self.layers = layers
        self.prepare_lora = prepare_lora
        self.calibration: dict[int, tuple[float, float]] = {}  # K -> (agreement, cost share)

    def propose(self, reqs: list[Req], lengths: list[int]) -> list[list[int]]:
        """Greedy drafts of lengths[i] tokens for reqs[i], which already holds slots for its
        last token and the drafts (its kv_len counts them)."""
        assert self.layers is not None
        drafts: list[list[int]] = [[] for _ in reqs]
        for j in range(max(lengths, default=0)):
            live = [i for i, d in enumerate(lengths) if d > j]
            ids, slots, prefix = [], [], []
            for i in live:
                req = reqs[i]
                pos = req.kv_len - 1 - lengths[i] + j  # the position fed at this draft step
                ids.append(req.output_ids[-1] if j == 0 else drafts[i][-1])
                slots.append(int(req.kv_slots[pos]))
                prefix.append(pos)
            fb = ForwardBatch.build(ids, torch.tensor(slots), [reqs[i].req_pool_idx for i in live],
                                    prefix, [1] * len(live), device=self.runner.device)
            fb.num_layers = self.layers
            fb.lora = self.prepare_lora([reqs[i].lora_name for i in live], [1] * len(live))
            tokens = self.runner.forward(fb).argmax(dim=-1).tolist()
            for i, token in zip(live, tokens):
                drafts[i].append(token)
        return drafts

    def calibrate(self, reqs: list[Req]) -> bool:
        """Pick K from `reqs`' computed tokens (True once picked): for each candidate K, how
        often the K-layer argmax agrees with the policy's at every position (teacher forced), and
        what a K-layer forward costs against the whole model's; K maximises the expected tokens
        per unit of cost at CALIBRATION_DRAFT. Runs on scratch KV slots, freed after."""
        seqs = [r.fill_ids[: min(r.kv_len, CALIBRATION_TOKENS)] for r in reqs[:4]]
        seqs = [s for s in seqs if len(s) >= 16]
        total = sum(map(len, seqs))
        runner = self.runner
        if not seqs or runner.allocator.available_size() < total + runner.config.page_size:
            return False
        rows = [runner.req_to_token_pool.alloc() for _ in seqs]
        slots = runner.allocator.alloc(total)
        try:
            if None in rows or slots is None:
                return False
            for row, part in zip(rows, slots.split([len(s) for s in seqs])):
                runner.req_to_token_pool.write(row, 0, part)
            num_layers = runner.model_config.num_layers
            candidates = sorted({max(1, num_layers * q // 8) for q in (1, 2, 3, 4)})
            target, full_s = self._argmax(seqs, rows, slots, None)
            for k in candidates:
                tokens, seconds = self._argmax(seqs, rows, slots, k)
                agree = float((tokens == target).float().mean())
                self.calibration[k] = (agree, seconds / full_s)
        finally:
            if slots is not None:
                runner.allocator.free(slots)
            for row in rows:
                if row is not None:
                    runner.req_to_token_pool.free(row)
        d = CALIBRATION_DRAFT
        self.layers = max(self.calibration, key=lambda k: expected_tokens(
            self.calibration[k][0], d) / (1 + d * self.calibration[k][1]))
        logger.info("self-draft calibration (K: agreement, cost share): %s -> K=%d",
                    {k: (round(a, 3), round(c, 3)) for k, (a, c) in self.calibration.items()},
                    self.layers)
        return True

    def _argmax(self, seqs: list[list[int]], rows: list[int], slots: torch.Tensor,
                layers: int | None) -> tuple[torch.Tensor, float]:
        lens = [len(s) for s in seqs]
        fb = ForwardBatch.build([t for s in seqs for t in s], slots, rows, [0] * len(seqs), lens,
                                list(range(sum(lens))), device=self.runner.device)
        fb.num_layers = layers
        start = time.perf_counter()
        tokens = self.runner.forward(fb).argmax(dim=-1)
        return tokens, time.perf_counter() - start
