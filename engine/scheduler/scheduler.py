"""The scheduler: one background thread that turns queued requests into batched forward steps.

Each step: give every decoding request a KV slot (evicting cached prefixes, then retracting the
most recently admitted requests when the pool is short), admit prefill work through the
PrefillAdder (a chunked request first, then the waiting queue in policy order), run one forward
over the mixed batch, sample, and hand results to the requests' sinks. Commands from the Engine
(weight updates, pause, flush) run in this thread between steps, so they never race a forward.
The thread blocks on its inbox when there is nothing to do.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from hotswap.engine.config import EngineConfig
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.core.namespace import Namespace, ServingVersion
from hotswap.engine.core.request import FinishReason, Req
from hotswap.engine.executor.model_runner import ModelRunner
from hotswap.engine.executor.omp import release_thread_team
from hotswap.engine.executor.sampling import Sampler
from hotswap.engine.grammar.manager import GrammarManager
from hotswap.engine.kvcache.handoff import HandoffRefused
from hotswap.engine.kvcache.hiradix_cache import make_radix_cache
from hotswap.engine.lora.manager import LoRAManager
from hotswap.engine.multimodal.encoder_cache import EncoderCache
from hotswap.engine.scheduler.control import SchedulerControl
from hotswap.engine.scheduler.kv_manager import KVManager, StepPeers
from hotswap.engine.scheduler.output import OutputProcessor
from hotswap.engine.scheduler.schedule_batch import BatchRow, ScheduleBatch
from hotswap.engine.scheduler.schedule_policy import NewTokenRatio, PrefillAdder, order_waiting
from hotswap.engine.scheduler.sessions import Sessions
from hotswap.engine.scheduler.step_outputs import StepOutputs
from hotswap.engine.speculative.speculator import Speculator

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Scheduler(SchedulerControl, StepOutputs):
    def __init__(self, config: EngineConfig, runner: ModelRunner, outputs: OutputProcessor,
                 serving: ServingVersion, lora: LoRAManager | None = None):
        self.config = config
        self.runner = runner
        self.outputs = outputs
        self.serving = serving  # written by the weight transactions, read here
        self.tree = make_radix_cache(config, runner.allocator, runner.kv_pool,
                                     runner.model.parameters, serving, runner.batch_invariant)
        self.kv = KVManager(runner.allocator, runner.req_to_token_pool, self.tree,
                            config.page_size)
        self.sessions = Sessions(self.tree, lambda: int(
            runner.allocator.size * config.session_budget_fraction))
        self.sampler = Sampler()
        self.lora = lora or LoRAManager(config, runner.model_config, runner.device, runner.dtype)
        self.grammars = GrammarManager(config.grammar_backend, outputs.tokenizer,
                                       runner.model_config.vocab_size, outputs.eos_ids,
                                       runner.device)
        self.grammar_queue: list[Req] = []  # waiting for their grammar to compile
        if config.speculative and config.deterministic and not runner.batch_invariant:
            raise ValueError("speculative with deterministic=True needs the batch-invariant CPU "
                             "kernels (rows run alone without them)")
        self.spec = (Speculator(config, runner, self.lora.prepare, serving.label)
                     if config.speculative else None)
        self.generator = torch.Generator(device=runner.device).manual_seed(config.seed)
        self.ratio = NewTokenRatio()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        # n > 1: samples 1.. wait here until sample 0 has prefilled the prompt, then start on
        # its KV and sample their first token from its logits (the prompt is computed once).
        self.forks: dict[str, list[Req]] = {}
        # Scheduling state: written on this thread only, by the control methods below.
        self.paused = False
        self.admission_held = False  # set while a flush waits for running requests to drain
        self.stats = {"prefill_tokens": 0, "prompt_tokens": 0, "generated_tokens": 0,
                      "cached_tokens": 0, "steps": 0, "step_s": 0.0,
                      # verify rows, drafted tokens they fed and kept, seconds spent drafting
                      "spec_verify_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                      "spec_draft_s": 0.0,
                      # KV handoffs taken in (their tokens) and refused (decode engines)
                      "handoff_tokens": 0, "handoffs_refused": 0}
        model = runner.model_config
        self.never_sampled = model.vision_token_ids
        # a vision-language model's encoder outputs (engine/multimodal/encoder_cache.py)
        self.encoder = EncoderCache(
            runner.model.encode_images, runner.model.vision_config.spatial_merge_size,
            int(config.encoder_cache_mb * 2**20), self.stats) if model.vision else None
        self._admit_counter = 0
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hotswap-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=30)
        self.grammars.shutdown()

    def submit(self, reqs: list[Req]) -> None:
        release_thread_team()  # the caller now waits on us: its idle OpenMP team throttles ours
        self._inbox.put(("reqs", reqs))

    def abort(self, rid: str | None, abort_all: bool = False) -> None:
        self._inbox.put(("abort", (rid, abort_all)))

    def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the scheduler thread between steps and return its result (its exception
        is raised here). The one way other threads act on scheduling state; on the scheduler
        thread itself `fn` runs at once."""
        if threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        release_thread_team()
        self._inbox.put(("call", (fn, future)))
        return future.result()

    def namespace(self, req: Req) -> Namespace:
        return Namespace(self.serving.label, req.lora_name, self.lora.version(req.lora_name),
                         req.cache_salt, self.serving.epoch)

    def is_live(self, req: Req) -> bool:
        """Whether `req`'s KV was computed by the current weights and adapter version."""
        return req.namespace is not None and req.namespace == self.namespace(req)

    @property
    def has_work(self) -> bool:
        ready = not self.paused and self.runner.kv_pool.allocated
        return ready and bool(self.running or self.waiting)

    def _loop(self) -> None:
        """Never dies (every part is guarded) and never spins (it blocks on the inbox unless
        there is work it can run)."""
        idle_wait = None  # block on the inbox: None = until something arrives
        while not self._stop.is_set():
            if not self.has_work:  # idle: keep no OpenMP team that would throttle the caller's
                release_thread_team()
            self.sessions.expire(time.monotonic())
            block = not self.has_work or idle_wait is not None
            expiry = self.sessions.seconds_to_expiry()  # a blocked wait ends at the next expiry
            timeout = idle_wait if expiry is None else min(idle_wait or expiry, expiry)
            self._drain_inbox(block=block, timeout=timeout)
            if self._stop.is_set():
                break
            if not self.has_work:
                idle_wait = None  # nothing to retry: sleep until a message arrives
                continue
            # Work that cannot be scheduled yet (e.g. admission held for a flush) must not
            # spin the thread: wait briefly on the inbox before trying again.
            idle_wait = None if self._guarded_step() else 0.01
            if not self.running and not self.waiting:
                self._idle_check()
        reason = FinishReason.aborted("shutdown", "aborted: the engine shut down")
        self.abort_running(reason)
        self.abort_waiting(reason)

    def _guarded_step(self) -> bool:
        try:
            return self.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
            logger.error("step failed: %s", traceback.format_exc())
            for req in self.running:  # this step's KV writes may be partial: not cached
                self.kv.release(req, cache=False)
            self.abort_running(FinishReason.aborted("error",
                                                    f"internal error in forward step: {exc!r}"))
            return True

    def _idle_check(self) -> None:
        """Invariant 2 while idle; a violation is logged and the cache rebuilt empty (nothing
        holds KV now), so the engine keeps serving instead of losing its thread."""
        try:
            self.kv.check_integrity([])
        except Exception:  # noqa: BLE001 - AssertionError included
            logger.error("KV integrity check failed while idle; dropping the prefix cache: %s",
                         traceback.format_exc())
            self._reset_kv()

    def _drain_inbox(self, block: bool, timeout: float | None = None) -> None:
        try:
            item = self._inbox.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return
        while True:
            try:
                self._handle(*item)
            except Exception:  # noqa: BLE001 - one bad message must not kill the engine
                logger.error("scheduler message %r failed: %s", item[0], traceback.format_exc())
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "reqs":
            for req in payload:
                if req.handoff is not None:
                    self._import_handoff(req)
                if req.finished:  # a handed-off sample that ended on the prefill engine
                    self.kv.unpin_handoff(req)
                    self.outputs.emit(req)
                    continue
                if req.params.max_new_tokens == 0 and req.scoring is None:
                    self.finish(req, FinishReason("length"))
                    continue
                if req.lora_name is not None and not self.lora.has(req.lora_name):
                    self.finish(req, FinishReason.aborted("adapter_unloaded", (
                        f"aborted: LoRA adapter {req.lora_name!r} was unloaded")))
                    continue
                self.stats["prompt_tokens"] += len(req.prompt_ids)
                if req.grammar is not None and not req.grammar.ready:
                    self._wait_for_grammar(req)
                else:
                    self._enqueue(req)
        elif kind == "grammar":
            self._grammars_ready()
        elif kind == "abort":
            self._abort(*payload)
        elif kind == "call":
            fn, future = payload
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - delivered to the caller
                    future.set_exception(exc)

    def _import_handoff(self, req: Req) -> None:
        """A decode engine takes a prefill engine's KV for `req`'s prompt into its tree, if
        it was computed under the namespace `req` runs in here; else `req` computes it."""
        start = time.perf_counter()
        incoming, req.handoff = req.handoff, None
        handoff, ns = incoming.handoff, self.namespace(req)
        result = {"id": handoff.id, "accepted": False, "tokens": 0, "reason": None,
                  "bytes": handoff.nbytes, **handoff.timings,
                  "receive_s": incoming.receive_s}
        try:
            hashes = [] if req.images is None else req.images.hashes
            reason = incoming.error or handoff.refusal(ns) or handoff.image_refusal(hashes)
            if reason is not None:
                raise HandoffRefused(reason)
            pool = self.runner.kv_pool
            result["tokens"] = self.kv.import_prefix(
                req, ns, req.cache_ids[: len(handoff.token_ids)],
                lambda slots: pool.write_tokens(incoming.kv, slots, incoming.routes))
            result["accepted"] = True
            self.stats["handoff_tokens"] += result["tokens"]
        except HandoffRefused as exc:
            result["reason"] = str(exc)
            self.stats["handoffs_refused"] += 1
        result["import_s"] = time.perf_counter() - start
        req.handoff_result = result

    def _enqueue(self, req: Req) -> None:
        if req.grammar is not None and req.output_ids:  # tokens sampled on a prefill engine
            req.grammar.replay(req.output_ids)
        leader = req.group_leader
        if leader is not None and not self.tree.disable and not leader.finished:
            self.forks.setdefault(leader.rid, []).append(req)
        else:
            self.waiting.append(req)

    def _wait_for_grammar(self, req: Req) -> None:
        """Park `req` until its grammar compiles (on the grammar worker); others keep stepping."""
        self.grammar_queue.append(req)
        req.grammar.job.add_done_callback(lambda _: self._inbox.put(("grammar", None)))

    def _grammars_ready(self) -> None:
        ready = [r for r in self.grammar_queue if r.grammar.ready]
        self.grammar_queue = [r for r in self.grammar_queue if not r.grammar.ready]
        for req in ready:
            error = req.grammar.error()
            if error is not None:
                self.finish(req, FinishReason.aborted("grammar", error))
            else:
                self._enqueue(req)

    def _abort(self, rid: str | None, abort_all: bool) -> None:
        def hit(req: Req) -> bool:
            return abort_all or req.rid == rid or req.rid.startswith(f"{rid}-")

        self._finish_where_now(hit, FinishReason.aborted("user", "aborted by request"), True)

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End `req`: free its KV (cached when still valid) and deliver its final output."""
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req.export_kv and reason.type != "abort" and self.is_live(req):
            self.kv.export_prompt(req, self.runner.kv_pool)
        self.kv.unpin_handoff(req)
        self._keep_routes(req)
        if (req.session_id is not None and reason.type != "abort"
                and req.req_pool_idx is not None and self.is_live(req)):
            self.kv.cache_unfinished(req)  # the turn's KV into the tree, then pinned there
            self.sessions.pin(req.session_id, req.last_node)
        self.kv.release(req)
        self.waiting[:0] = self.forks.pop(req.rid, [])  # the leader is gone: prefill normally
        self.outputs.emit(req)

    def abort_running(self, reason: FinishReason) -> None:
        for req in list(self.running):
            self.finish(req, reason)

    def abort_waiting(self, reason: FinishReason) -> None:
        waiting = self.waiting + [r for forks in self.forks.values() for r in forks]
        waiting += self.grammar_queue
        self.waiting, self.forks, self.grammar_queue = [], {}, []
        for req in waiting:
            self.finish(req, reason)

    def retract(self, req: Req) -> None:
        """Drop `req`'s KV and queue it (first) to be recomputed from prompt + output so far."""
        self.running.remove(req)
        self._keep_routes(req)
        self.kv.release(req)
        req.spec_state = None  # a learned draft's KV went with the request's
        req.prefill_done = False
        req.token_scores = []  # a scored request computes every position again
        req.num_retractions += 1
        if req.grammar is not None:  # recomputed from every kept token: the matcher agrees
            req.grammar.sync(len(req.output_ids))
        self.waiting.insert(0, req)

    def _keep_routes(self, req: Req) -> None:
        """Before `req`'s KV goes: the routing of its positions (return_routed_experts). What
        was kept before a retraction stays: it produced the tokens sampled then; recomputed
        positions (under newer weights) add only what lies past it."""
        pool = self.runner.kv_pool
        if not req.return_routed_experts or req.req_pool_idx is None or pool.routes is None:
            return
        kept = req.routed_experts
        start = 0 if kept is None else len(kept)
        new = pool.read_routes(req.kv_slots[start:])
        req.routed_experts = new if kept is None else torch.cat((kept, new))

    def retract_all(self) -> None:
        for req in sorted(self.running, key=lambda r: -r.admit_seq):
            self.retract(req)

    def step(self) -> bool:
        """One forward step; False when nothing could be scheduled."""
        start = time.perf_counter()
        batch = self._schedule()
        if batch is None:
            return False
        version = self.serving.label
        decode_only = all(row.req.prefill_done for row in batch.rows)
        generated = self.stats["generated_tokens"]
        # Grammar masks of this step's rows are filled on a worker while the forward runs.
        masks = self.grammars.prefetch(self._sampled_reqs(batch.sampling_rows))
        if self.config.deterministic and not self.runner.batch_invariant:
            logits = torch.cat([self.runner.forward(self._with_lora(
                ScheduleBatch.build([row], self.runner.device))) for row in batch.rows])
        else:
            logits = self.runner.forward(self._with_lora(batch))
        self.stats["steps"] += 1
        self.stats["prefill_tokens"] += sum(r.extend for r in batch.rows if not r.req.prefill_done)
        if self.runner.model_config.num_labels:  # a reward model: every row is a classify one
            self._process_scores(batch, logits, version)
        else:
            self._process(batch, logits, version, masks)
        seconds = time.perf_counter() - start
        self.stats["step_s"] += seconds
        if self.spec is not None and decode_only:
            self.spec.record(len(batch.rows), self.stats["generated_tokens"] - generated, seconds)
        return True

    def _with_lora(self, batch: ScheduleBatch) -> ForwardBatch:
        """The batch's forward inputs with its adapters' and images' parts."""
        rows, fb = batch.rows, batch.forward_batch
        fb.lora = self.lora.prepare([r.req.lora_name for r in rows], [r.extend for r in rows])
        if batch.image_spans:
            fb.vision = self.encoder.vision_inputs(batch.image_spans)
        return fb

    def _schedule(self) -> ScheduleBatch | None:
        rows = self._reserve_decode()
        rows += self._admit_prefill()
        if not rows:
            return None
        return ScheduleBatch.build(rows, self.runner.device)

    def _reserve_decode(self) -> list[BatchRow]:
        decode = [r for r in self.running if r.prefill_done]
        start = time.perf_counter()
        plan = self.spec.plan(decode) if self.spec is not None and decode else None
        while decode:
            lens = [1] * len(decode) if plan is None else [
                1 + (p if isinstance(p, int) else len(p)) for p in plan]
            if self.kv.alloc(decode, lens) is not None:
                self.ratio.step()
                if plan is None:
                    return [BatchRow(r, 1, True) for r in decode]
                drafts, sampled = self.spec.propose(decode, plan, self.generator)
                self.stats["spec_draft_s"] += time.perf_counter() - start
                return [BatchRow(r, 1 + len(d), True, d, s)
                        for r, d, s in zip(decode, drafts, sampled)]
            if plan is not None:  # short of KV: no drafts this step before any retraction
                plan = self.spec.skip()
                continue
            if len(self.running) == 1:
                self.finish(decode[0], FinishReason(
                    "abort", message="KV pool too small for this request's context"))
                return []
            victim = max(decode, key=lambda r: r.admit_seq)
            decode.remove(victim)
            self.retract(victim)
            self.ratio.reset()
        return []

    def _reserved_tokens(self) -> int:
        return int(sum(r.remaining_new_tokens for r in self.running) * self.ratio.value)

    def _admit_prefill(self) -> list[BatchRow]:
        cfg = self.config
        adder = PrefillAdder(self.kv.available(), self._reserved_tokens(), cfg.max_prefill_tokens,
                             cfg.chunked_prefill_size, len(self.running),
                             cfg.max_running_requests, self.ratio.value, cfg.page_size)
        rows = []
        chunking = False
        for req in [r for r in self.running if not r.prefill_done]:
            row = self._plan_prefill(adder, req, may_chunk=True, new=False)
            if row is None:
                continue
            rows.append(row)
            chunking = chunking or not row.samples
        if self.admission_held or not self.waiting:
            return rows
        share = self.config.enable_prefix_cache and not self.tree.disable
        prefix = (lambda r: self.kv.match_len(self.namespace(r), r)) if share else None
        peers = None
        if share:  # requests admitted in this step share their prefixes through it
            peers = StepPeers()
            for row in rows:
                peers.add(row.req)
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        for req in order_waiting(self.waiting, cfg.schedule_policy, prefix):
            if not adder.room_for_new_request():
                break
            if not self.lora.admissible(req, adapters):  # max_loras_per_batch: try others
                continue
            if not self.kv.admit(req, self.namespace(req), peers):
                break
            cached = req.kv_len
            row = self._plan_prefill(adder, req, may_chunk=not chunking, new=True)
            if row is None:
                self.kv.release(req, cache=False)
                break
            self.waiting.remove(req)
            self.running.append(req)
            adapters.update([req.lora_name] if req.lora_name is not None else [])
            self._admit_counter += 1
            req.admit_seq = self._admit_counter
            self.stats["cached_tokens"] += cached
            rows.append(row)
            if peers is not None:
                peers.add(req)
            chunking = chunking or not row.samples
        return rows

    def _plan_prefill(self, adder: PrefillAdder, req: Req, may_chunk: bool, new: bool
                      ) -> BatchRow | None:
        todo = len(req.fill_ids) - req.kv_len
        extend = adder.plan_extend(req, todo, may_chunk)
        if extend == 0 or self.kv.alloc([req], [extend]) is None:
            return None
        adder.take(req, extend, new)
        return BatchRow(req, extend, samples=extend == todo)

    def _start_forks(self, leader: Req) -> list[Req]:
        """Start the samples waiting on `leader`'s prompt; those that cannot go to the queue."""
        started = []
        for req in self.forks.pop(leader.rid, []):
            room = len(self.running) < self.config.max_running_requests
            if room and self.is_live(leader) and self.kv.fork(req, leader):
                req.prefill_done = True
                self.running.append(req)
                self._admit_counter += 1
                req.admit_seq = self._admit_counter
                self.stats["cached_tokens"] += req.kv_len
                started.append(req)
            else:
                self.waiting.insert(0, req)
        return started
