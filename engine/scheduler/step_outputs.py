"""StepOutputs: what a forward step's logits become: sampled tokens appended to their requests,
verify rows' kept drafts (engine/speculative/verify.py), logprobs, versions, finishes; on a
reward model, the classify requests' scores.

Mixed into Scheduler, which provides the state below and `finish`, `retract`, `is_live` and
`_start_forks`; it runs on the scheduler thread, after the forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hotswap.engine.core.request import FinishReason, Req
from hotswap.engine.executor.sampling import SampledChecks
from hotswap.engine.executor.sampling_batch_info import SamplingBatchInfo
from hotswap.engine.scheduler.schedule_batch import BatchRow, ScheduleBatch
from hotswap.engine.speculative.verify import accepted_length

if TYPE_CHECKING:
    from hotswap.engine.executor.sampling import Sampler
    from hotswap.engine.grammar.manager import GrammarManager
    from hotswap.engine.lora.manager import LoRAManager
    from hotswap.engine.scheduler.kv_manager import KVManager
    from hotswap.engine.scheduler.output import OutputProcessor
    from hotswap.engine.speculative.speculator import Speculator


class StepOutputs:
    kv: KVManager
    sampler: Sampler
    grammars: GrammarManager
    lora: LoRAManager
    outputs: OutputProcessor
    generator: torch.Generator
    stats: dict[str, float]
    never_sampled: tuple[int, ...]  # a vision-language model's vision tokens
    spec: Speculator | None

    @staticmethod
    def _sampled_reqs(rows: list[BatchRow]) -> list[Req]:
        """The request of every sampled position, in logits order (a verify row has several)."""
        return [row.req for row in rows for _ in range(1 + len(row.draft))]

    def _process(self, batch: ScheduleBatch, logits: torch.Tensor, version: str,
                 prefetched_masks: Any = None) -> None:
        for row in batch.rows:
            if not row.samples:  # a chunk: share what is computed so far
                self.kv.cache_unfinished(row.req)
        rows, logits = self._fail_non_finite(batch.sampling_rows, logits, version)
        # (request, its first logits row, its draft); forked samples read their leader's row
        entries, first, sampled = [], 0, []
        for row in rows:
            entries.append((row.req, first, row.draft))
            first += 1 + len(row.draft)
            sampled.append(row.sampled)
        for req, i, _ in list(entries):
            if not req.prefill_done:
                req.prefill_done = True
                self.kv.cache_unfinished(req)
                entries += [(fork, i, []) for fork in self._start_forks(req)]
        if not entries:
            return
        # One sampling row per position: position j of a verify row has seen draft[:j].
        reqs, take, outputs, steps, checks = [], [], [], [], []
        for (req, i, draft), drawn in zip(entries, sampled + [None] * len(entries)):
            if drawn is not None:
                checks += [(len(take) + j, draft[j], drawn, j) for j in range(len(draft))]
            for j in range(len(draft) + 1):
                reqs.append(req)
                take.append(i + j)
                outputs.append(req.output_ids + draft[:j] if j else req.output_ids)
                steps.append(len(req.output_ids) + j)
        if take != list(range(logits.shape[0])):
            logits = logits[torch.tensor(take, device=logits.device)]
        info = SamplingBatchInfo.build(
            [r.params for r in reqs], outputs, [r.prompt_ids for r in reqs], steps,
            self.outputs.eos_ids, logits.shape[-1], logits.device, self.never_sampled)
        masks = self.grammars.step_masks(reqs, prefetched_masks, logits.device)
        if masks is not None:
            info.grammar_rows, info.grammar_bitmask = masks
        top_k = max(r.top_logprobs_num for r in reqs)
        want_logprob = any(r.return_logprob for r in reqs)
        out = self.sampler.sample(logits, info, return_logprob=want_logprob,
                                  top_logprobs_num=top_k, generator=self.generator,
                                  checks=self._sampled_checks(checks))
        next_ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist() if want_logprob else [0.0] * len(reqs)
        tops = self._top_lists(out, reqs)
        pos = 0
        for req, _, draft in entries:
            n = len(draft) + 1
            self._emit(req, draft, next_ids[pos: pos + n], logprobs[pos: pos + n],
                       tops[pos: pos + n], version)
            pos += n

    @staticmethod
    def _sampled_checks(checks: list[tuple[int, int, Any, int]]) -> SampledChecks | None:
        """The positions of the step's sampled drafts: (sampling row, token, SampledDraft,
        position in the draft) each."""
        if not checks:
            return None
        rows, tokens, drawn, at = zip(*checks)
        return SampledChecks(torch.tensor(rows), torch.tensor(tokens),
                             torch.stack([d.q[j] for d, j in zip(drawn, at)]),
                             torch.stack([d.index[j] for d, j in zip(drawn, at)]),
                             drawn[0].token_map)

    def _process_scores(self, batch: ScheduleBatch, scores: torch.Tensor, version: str) -> None:
        """A reward model's step: each classify row takes its rows of `scores`, and a request
        whose prompt is now computed finishes with them (it never samples)."""
        all_finite = bool(torch.isfinite(scores).all())
        first = 0
        for row in batch.rows:
            req, count = row.req, row.scored
            part, first = scores[first: first + count], first + count
            if not all_finite and not bool(torch.isfinite(part).all()):
                self.kv.release(req, cache=False)
                self.finish(req, FinishReason.aborted("non_finite", (
                    f"the model produced non-finite scores (NaN or inf) under weight version "
                    f"{version!r}; the request was stopped")))
                continue
            if req.scoring.per_token:
                req.token_scores.append(part)
            self.kv.cache_unfinished(req)
            if not row.samples:
                continue
            if not self.is_live(req):  # earlier chunks ran under weights since replaced
                self.retract(req)
                continue
            req.prefill_done = True
            req.scores, req.scored_version = part[-1], version
            self.finish(req, FinishReason("stop"))

    def _emit(self, req: Req, draft: list[int], tokens: list[int], logprobs: list[float],
              tops: list[Any], version: str) -> None:
        """Append what one row sampled: its next token or, after a verify, the drafts the
        target's draws kept and the target's own next token (engine/speculative/verify.py)."""
        kept = accepted_length(draft, tokens) if draft else 0
        adapter = None if req.lora_name is None else self.lora.version(req.lora_name)
        reason = None
        for j in range(kept + 1):
            req.output_ids.append(tokens[j])
            if req.return_logprob:
                req.output_logprobs.append(logprobs[j])
            if req.top_logprobs_num:
                req.output_top_logprobs.append(tops[j][: req.top_logprobs_num])
            req.stamp(version, adapter)
            self.stats["generated_tokens"] += 1
            reason = self.grammars.accept(req) if req.grammar is not None else None
            reason = reason or self.outputs.check_finish(req)
            if reason is None and req.export_kv:  # a prefill engine's part ends here
                reason = FinishReason("handoff")
            if reason is not None:
                break
        if draft:
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += kept
            self.stats["spec_verify_steps"] += 1
            self.stats["spec_draft_tokens"] += len(draft)
            self.stats["spec_accepted_tokens"] += kept
            if self.spec is not None:
                self.spec.verified(len(draft), kept)
            # KV of verified tokens only: every token but the newest (which has none yet)
            self.kv.truncate(req, len(req.prompt_ids) + len(req.output_ids) - 1)
        if reason is not None:
            self.finish(req, reason)
        elif req.stream and not self.outputs.emit(req):
            self.finish(req, FinishReason.aborted("undelivered", "its output could not be "
                                                  "delivered (the consumer is gone)"))

    def _fail_non_finite(self, rows: list[BatchRow], logits: torch.Tensor, version: str
                         ) -> tuple[list[BatchRow], torch.Tensor]:
        """End the requests whose logits hold NaN or inf (weights that diverged, an overflow)
        with an abort that says so, instead of sampling garbage; their KV is not cached."""
        if not rows or bool(torch.isfinite(logits.sum(-1)).all()):  # NaN/inf survive a row sum
            return rows, logits
        finite = torch.isfinite(logits).all(-1).tolist()
        message = (f"the model produced non-finite logits (NaN or inf) under weight version "
                   f"{version!r}; the request was stopped")
        kept_rows, keep, first = [], [], 0
        for row in rows:  # a verify row owns 1 + len(draft) logits rows
            span = range(first, first + 1 + len(row.draft))
            first = span.stop
            if all(finite[i] for i in span):
                kept_rows.append(row)
                keep.extend(span)
            else:
                self.kv.release(row.req, cache=False)
                self.finish(row.req, FinishReason.aborted("non_finite", message))
        return kept_rows, logits[keep]

    @staticmethod
    def _top_lists(out: Any, reqs: list[Req]) -> list[list[list[float | int]]]:
        if out.top_logprob_ids is None or not any(r.top_logprobs_num for r in reqs):
            return [[] for _ in reqs]
        ids, vals = out.top_logprob_ids.tolist(), out.top_logprob_values.tolist()
        return [[[v, t] for v, t in zip(vr, ir)] for vr, ir in zip(vals, ids)]
