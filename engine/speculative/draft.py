"""Learned drafts (speculative="draft"): the EAGLE-style head of engine/models/draft.py, run on
the paged KV of the policy's requests.

The draft has one layer of KV of its own, in a pool of one layer that shares the policy's slots
(the draft's K/V of position s sits in the slot of the policy's position s), and reads the
policy's normed last hidden state of every slot, which each policy forward stores
(ModelRunner.features). A request's draft KV covers its first `DraftState.kv_len` positions,
computed from the policy's states; each step first catches up over the positions verified
since (the prompt, at first), in one forward for the whole batch, then chains: every further
drafted position consumes the draft's own guess of the state before it.

How a row drafts (verify.py has the rules):
- sampled over the whole vocabulary without a seed: a draw from the draft's distribution q at
  the row's temperature times the draft's `proposal_scale` (its config's, measured by the warm
  start: a sharper q than the draft's own overlaps p more), verified by the min(1, p/q) rule
  with that q;
- the same with a seed: the token the target is likeliest to draw at the very uniform u it
  draws that position with (seeded_uniform(seed, step)), verified by the point-mass rule, so
  the row still emits exactly the tokens its seed gives without speculation (invariant 6). The
  target's token is the inverse CDF of p at u in vocabulary order; a learned q's CDF drifts
  from p's along the vocabulary (every token's error shifts all later intervals), so the draft
  takes the token whose q-interval covers most of u +- COUPLING_WINDOW rather than q's own
  inverse CDF at u (measured in docs/performance.md#learned-drafts);
- greedy or truncated (top-k / top-p / min-p): the draft's argmax, point-mass rule.

The draft's tensors are `draft.*` weights of the policy: an update that writes them makes the
draft current with the version it commits; one that does not leaves it stale (made for an
older policy). Stale or not, acceptance is measured live, and a draft whose acceptance falls
below ACCEPTANCE_FLOOR stops drafting, with a warning, until an update brings new draft tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from hotswap.engine.attention import get_backend_class
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.core.request import Req
from hotswap.engine.core.sampling_params import seeded_uniform
from hotswap.engine.executor.model_runner import ModelRunner
from hotswap.engine.executor.sampling import draw
from hotswap.engine.kvcache.memory import KVPool

logger = logging.getLogger(__name__)

# Kept drafted tokens per drafted token below which drafting stops: one drafted token then adds
# less than the 0.15 tokens a step it costs to draft and verify it at batch 1 (docs/performance.md).
ACCEPTANCE_FLOOR = 0.15
FLOOR_TOKENS = 512  # drafted tokens measured (since the draft or the policy last changed) first


class SampledDraft(NamedTuple):
    """A row's drafts drawn from the draft's distribution: what the min(1, p/q) rule needs."""

    q: torch.Tensor  # [d, Vd] float32: q at each drafted position, over the token map
    index: torch.Tensor  # [d] int64: each drafted token's index in the token map
    token_map: torch.Tensor  # [Vd] int64


@dataclass
class DraftState:
    """req.spec_state of a request that drafts: its first kv_len positions hold draft KV made
    from the policy's states (a retraction drops it with the KV)."""

    kv_len: int = 0


GREEDY, SAMPLED, COUPLED = 0, 1, 2  # how a row drafts (the module docstring)
COUPLING_WINDOW = 0.3  # of the CDF; near 0 the pick is q's inverse CDF at u, 1 q's argmax


def draft_mode(req: Req, vocab: int) -> int:
    p = req.params
    whole = (not p.is_greedy and (p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0
             and p.min_p <= 0.0)
    return GREEDY if not whole else SAMPLED if p.seed is None else COUPLED


def coupled_pick(q: torch.Tensor, u: float, window: float = COUPLING_WINDOW) -> torch.Tensor:
    """The index whose interval of q's CDF (vocabulary order) covers most of [u - window,
    u + window]: a seeded row's draft (the module docstring)."""
    q = q.double() / q.double().sum()
    upper = q.cumsum(0)
    return (upper.clamp(max=u + window) - (upper - q).clamp(min=u - window)).argmax()


class LearnedDraft:
    def __init__(self, runner: ModelRunner, version: str):
        self.runner = runner
        self.model = runner.model.draft
        self.embed = runner.model.model.embed_tokens
        self.rotary = runner.model.model.rotary
        cfg, pool = runner.model_config, runner.kv_pool
        self.vocab = cfg.vocab_size
        self.kv = KVPool(pool.num_pages, pool.page_size, 1, cfg.num_kv_heads, cfg.head_dim,
                         runner.dtype, runner.device)
        self.backend = get_backend_class(runner.config.attention_backend)(
            self.kv, runner.req_to_token_pool.req_to_token, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.head_dim ** -0.5)
        self.backend.batch_invariant = runner.batch_invariant
        self.version = version  # the policy version its tensors were written with
        self.serving = version
        self.off_reason: str | None = None
        self.floor = ACCEPTANCE_FLOOR  # (a benchmark pinning draft lengths sets it to 0)
        self.drafted = self.kept = 0  # since the draft or the policy last changed

    @property
    def active(self) -> bool:
        return self.off_reason is None

    # drafting

    @torch.inference_mode()
    def propose(self, reqs: list[Req], lengths: list[int], generator: torch.Generator | None
                ) -> tuple[list[list[int]], list[SampledDraft | None]]:
        """Drafts of lengths[i] tokens for reqs[i], which holds slots for its last token and the
        drafts (kv_len counts them); each row's SampledDraft where it drew from q."""
        drafts: list[list[int]] = [[] for _ in reqs]
        sampled: list[SampledDraft | None] = [None] * len(reqs)
        live = [i for i, d in enumerate(lengths) if d > 0]
        if not live:
            return drafts, sampled
        modes = [draft_mode(reqs[i], self.vocab) for i in live]
        qs: list[list[torch.Tensor]] = [[] for _ in live]
        picks: list[list[int]] = [[] for _ in live]
        guess = self._catch_up([reqs[i] for i in live], [lengths[i] for i in live])
        for j in range(max(lengths)):
            rows = [k for k, i in enumerate(live) if lengths[i] > j]
            if j:
                guess = self._chain([reqs[live[k]] for k in rows], [lengths[live[k]] for k in rows],
                                    [drafts[live[k]][-1] for k in rows], guess, j)
            logits = self.model.logits(guess)
            index = self._draw(logits, [reqs[live[k]] for k in rows],
                               [modes[k] for k in rows], j, qs, rows, generator)
            tokens = self.model.token_map[index].tolist()
            for k, token, at in zip(rows, tokens, index.tolist()):
                drafts[live[k]].append(token)
                picks[k].append(at)
            keep = [n for n, k in enumerate(rows) if lengths[live[k]] > j + 1]
            guess = guess[keep] if len(keep) < len(rows) else guess
        for k, i in enumerate(live):
            if modes[k] == SAMPLED:
                sampled[i] = SampledDraft(torch.stack(qs[k]), torch.tensor(picks[k]),
                                          self.model.token_map)
        return drafts, sampled

    def _catch_up(self, reqs: list[Req], lengths: list[int]) -> torch.Tensor:
        """Draft KV for each request's positions from its DraftState.kv_len up to its last
        token, from the policy's stored states; the guesses G at each last token [rows, H]."""
        ids, slots, feature_slots, prefix, extend, pool_rows = [], [], [], [], [], []
        for req, d in zip(reqs, lengths):
            if req.spec_state is None:
                req.spec_state = DraftState()
            n = req.kv_len - d  # the request's tokens (its last one is at n - 1)
            start = min(req.spec_state.kv_len, n - 1)
            p = len(req.prompt_ids)  # fill_ids[start:n] without copying the whole sequence
            ids += req.prompt_ids[start:n] + req.output_ids[max(0, start - p):n - p]
            slots.append(req.kv_slots[start:n])
            # F_{s-1} for every s: slot 0 (page 0, kept zero) stands for F_{-1}
            feature_slots.append(req.kv_slots[start - 1:n - 1] if start else
                                 torch.cat((torch.zeros(1, dtype=torch.int64),
                                            req.kv_slots[:n - 1])))
            prefix.append(start)
            extend.append(n - start)
            pool_rows.append(req.req_pool_idx)
            req.spec_state.kv_len = n
        features = self.runner.features[torch.cat(feature_slots).to(self.runner.device)]
        fb = ForwardBatch.build(ids, torch.cat(slots), pool_rows, prefix, extend,
                                device=self.runner.device)
        return self._forward(fb, features)[fb.logits_indices]

    def _chain(self, reqs: list[Req], lengths: list[int], tokens: list[int],
               guess: torch.Tensor, j: int) -> torch.Tensor:
        """Draft step j: each row's drafted token j - 1 with the guess that drew it."""
        positions = [req.kv_len - d - 1 + j for req, d in zip(reqs, lengths)]
        slots = torch.stack([req.kv_slots[p] for req, p in zip(reqs, positions)])
        fb = ForwardBatch.build(tokens, slots, [r.req_pool_idx for r in reqs], positions,
                                [1] * len(reqs), device=self.runner.device)
        return self._forward(fb, guess)

    def _forward(self, fb: ForwardBatch, features: torch.Tensor) -> torch.Tensor:
        fb.attn_backend = self.backend
        self.backend.init_forward_metadata(fb)
        embeds = self.embed(fb.input_ids)
        fb.rope = self.rotary.lookup(fb.positions, embeds.dtype)
        return self.model(embeds, features, fb)

    def _draw(self, logits: torch.Tensor, reqs: list[Req], modes: list[int], j: int,
              qs: list[list[torch.Tensor]], rows: list[int],
              generator: torch.Generator | None) -> torch.Tensor:
        """Each row's drafted index into the token map at draft position j (the module
        docstring); SAMPLED rows keep their q for verification."""
        index = logits.argmax(dim=-1)
        picked = [n for n, m in enumerate(modes) if m != GREEDY]
        if not picked:
            return index
        at = torch.tensor(picked, device=logits.device)
        scale = self.model.proposal_scale
        temps = torch.tensor([reqs[n].params.temperature * (scale if modes[n] == SAMPLED else 1)
                              for n in picked], dtype=torch.float32, device=logits.device)
        q = torch.softmax(logits[at] / temps[:, None], dim=-1)
        drawn = draw(q, generator)
        for k, n in enumerate(picked):
            if modes[n] == SAMPLED:
                index[n] = drawn[k]
                qs[rows[n]].append(q[k])
            else:  # the target's own uniform for this position: see the module docstring
                req = reqs[n]
                u = seeded_uniform(req.params.seed, len(req.output_ids) + j)
                index[n] = coupled_pick(q[k], u)
        return index

    # freshness and acceptance

    def verified(self, drafted: int, kept: int) -> None:
        """A verify row kept `kept` of its `drafted` tokens."""
        self.drafted += drafted
        self.kept += kept
        if self.off_reason is None and self.drafted >= FLOOR_TOKENS:
            rate = self.kept / self.drafted
            if rate < self.floor:
                self.off_reason = (
                    f"acceptance {rate:.3f} below the floor {self.floor} over "
                    f"{self.drafted} drafted tokens (draft of version {self.version!r}, policy "
                    f"{self.serving!r})")
                logger.warning("learned draft switched off: %s; it drafts again once an "
                               "update brings draft.* tensors", self.off_reason)

    def weights_served(self, version: str, written: set[str]) -> None:
        """An update committed `version`; with `written` draft tensors the draft is current
        (and drafts again), without it stale: acceptance is measured again either way."""
        self.serving = version
        if any(name.startswith("draft.") for name in written):
            self.version = version
            self.off_reason = None
        self.drafted = self.kept = 0

    def memory(self, release: bool) -> None:
        """Free this draft's KV and the stored states with the KV pool, or allocate them."""
        runner = self.runner
        if release:
            self.kv.release()
            runner.features = runner.features.new_empty((0, runner.features.shape[1]))
        else:
            self.kv.allocate()
            runner.features = runner.features.new_zeros((self.kv.num_slots,
                                                         runner.features.shape[1]))

    def describe(self) -> dict[str, Any]:
        return {"draft_version": self.version, "stale": self.version != self.serving,
                "active": self.active, "off_reason": self.off_reason,
                "acceptance": self.kept / self.drafted if self.drafted else None,
                "vocab": int(self.model.token_map.numel()),
                "proposal_scale": self.model.proposal_scale}
