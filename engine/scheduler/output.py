"""Finish checks (eos, stop ids, stop strings, length) and the outputs a request hands back."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from hotswap.engine.core.request import FinishReason, IncrementalDetokenizer, Req, VersionSpan

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_ids: set[int], context_length: int):
        self.tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids)
        self._eos = set(eos_ids)
        self.context_length = context_length

    def check_finish(self, req: Req) -> FinishReason | None:
        """Why `req` stops after its newest token, or None to keep going."""
        p = req.params
        token = req.output_ids[-1]
        if not p.ignore_eos and token in self._eos:
            return FinishReason("stop", matched=token)
        if token in p.stop_token_ids:
            return FinishReason("stop", matched=token)
        if p.stop or req.stream:
            self._detokenize(req)
            matched = self._match_stop_string(req)
            if matched is not None:
                return FinishReason("stop", matched=matched)
        if len(req.output_ids) >= p.max_new_tokens:
            return FinishReason("length")
        if len(req.prompt_ids) + len(req.output_ids) >= self.context_length:
            return FinishReason("length", message="reached the model's context length")
        return None

    def _detokenize(self, req: Req) -> None:
        if req.detok is None:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens)
        req.detok.update(req.output_ids)

    @staticmethod
    def _match_stop_string(req: Req) -> str | None:
        text = req.detok.text
        longest = max((len(s) for s in req.params.stop), default=0)
        start = max(0, req.stop_scan_from - longest + 1)
        req.stop_scan_from = len(text)
        hits = [(text.find(s, start), s) for s in req.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        return min(hits)[1] if hits else None

    def final_text(self, req: Req) -> str:
        text = self.tokenizer.decode(req.output_ids,
                                     skip_special_tokens=req.params.skip_special_tokens)
        matched = req.finish_reason.matched if req.finish_reason else None
        if isinstance(matched, str):
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text

    def emit(self, req: Req) -> bool:
        """Deliver the final output, or for a stream the part not yet sent.

        False when the request's sink raised (e.g. its asyncio loop is closed): the sink is
        dropped, and only this request is affected; the caller ends it if it still runs.
        """
        if req.sink is None:
            return True
        if req.scoring is not None:
            event = self.build_scores(req)
        elif req.stream:
            event = self._stream_delta(req)
        elif req.finished:
            event = self.build(req, self.final_text(req), req.output_ids, req.output_logprobs,
                               req.output_top_logprobs)
        else:
            return True
        try:
            req.sink(event)
        except Exception:  # noqa: BLE001 - the consumer's failure, not the engine's
            logger.warning("request %s: output sink failed; dropping it", req.rid,
                           exc_info=True)
            req.sink = None
            return False
        return True

    def _stream_delta(self, req: Req) -> dict[str, Any]:
        if req.finished:
            text = self.final_text(req)
            safe = len(text)
        else:
            text = req.detok.text if req.detok else ""
            holdback = max((len(s) for s in req.params.stop), default=1) - 1
            safe = max(req.streamed_text, len(text) - holdback)
        delta = text[req.streamed_text: safe]
        lo, hi = req.streamed_ids, len(req.output_ids)
        out = self.build(req, delta, req.output_ids[lo:hi], req.output_logprobs[lo:hi],
                         req.output_top_logprobs[lo:hi])
        req.streamed_text, req.streamed_ids = max(req.streamed_text, safe), hi
        return out

    def build(self, req: Req, text: str, ids: list[int], logprobs: list[float],
              tops: list[Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason.to_dict() if req.finish_reason else None,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "cached_tokens_details": {
                "device": req.cached_tokens - req.cached_from_host - req.cached_from_storage,
                "host": req.cached_from_host, "storage": req.cached_from_storage},
            "weight_version": req.version_spans[-1].version if req.version_spans else None,
            "weight_versions": [_span(s) for s in req.version_spans],
            "num_retractions": req.num_retractions,
            "spec_verify_ct": req.spec_verify_ct,  # verify steps; each kept accepted / ct drafts
            "spec_accepted_tokens": req.spec_accepted_tokens,
            "e2e_latency": time.perf_counter() - req.created,
        }
        if req.images is not None:  # what a trainer needs to score the same tokens
            meta["prompt_ids"] = list(req.prompt_ids)
            meta["images"] = [p.meta() for p in req.images.images]
        if req.lora_name is not None:
            meta["lora_name"] = req.lora_name
            meta["adapter_version"] = (req.version_spans[-1].adapter_version
                                       if req.version_spans else None)
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t] for lp, t in zip(logprobs, ids)]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = list(tops)
        if req.kv_export is not None:  # the Engine turns it into meta_info["kv_handoff"]
            meta["kv_export"] = req.kv_export
        if req.handoff_result is not None:
            meta["kv_handoff"] = req.handoff_result
        if req.return_routed_experts and req.finish_reason is not None:
            meta["routed_experts"] = (None if req.routed_experts is None
                                      else req.routed_experts.numpy())
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    @staticmethod
    def build_scores(req: Req) -> dict[str, Any]:
        """A classify request's output (docs/api.md#scoring); scores are None when it was
        aborted."""
        scoring = req.scoring
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason.to_dict() if req.finish_reason else None,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": 0,
            "cached_tokens": req.cached_tokens,
            "weight_version": req.scored_version,
            "num_retractions": req.num_retractions,
            "e2e_latency": time.perf_counter() - req.created,
        }
        done = req.scores is not None
        out: dict[str, Any] = {"scores": scoring.finish(req.scores[None])[0].tolist()
                               if done else None}
        if scoring.per_token:
            rows = torch.cat(req.token_scores).cpu() if done else None
            if scoring.step_tag_id is None:
                out["token_scores"] = scoring.finish(rows).tolist() if done else None
            else:
                at = torch.tensor(req.prompt_ids) == scoring.step_tag_id
                out["step_scores"] = scoring.finish(rows[at]).tolist() if done else None
        out["meta_info"] = meta
        return out


def _span(span: VersionSpan) -> dict[str, Any]:
    """A version span; LoRA requests' spans also name their adapter version."""
    out = {"version": span.version, "start": span.start, "end": span.end}
    if span.adapter_version is not None:
        out["adapter_version"] = span.adapter_version
    return out
