"""Engine: the in-process implementation of EngineClient (docs/api.md#engine), over the
scheduler thread."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import json
import os
import queue
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from transformers import AutoTokenizer

from hotswap.engine.client.protocol import (
    EngineClient,
    check_pause_mode,
    check_update_model,
    memory_tags,
    resolve_commit,
)
from hotswap.engine.client.request import ClassifyRequest, DistributedUpdate, GenerateRequest
from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.core.namespace import ServingVersion
from hotswap.engine.core.request import Req
from hotswap.engine.distributed.launch import make_runner, resolve_launch
from hotswap.engine.executor.omp import in_own_thread
from hotswap.engine.lora.manager import LoRAManager
from hotswap.engine.multimodal.image_processing import ImageProcessorConfig
from hotswap.engine.request_builder import RequestBuilder
from hotswap.engine.roles import PrefillDecodeRoles
from hotswap.engine.scheduler.output import OutputProcessor
from hotswap.engine.scheduler.scheduler import Scheduler
from hotswap.engine.weights.weight_manager import WeightManager
from hotswap.weight_sync.delta import Delta
from hotswap.weight_sync.serialize import deserialize_named_tensors


class Engine(PrefillDecodeRoles, EngineClient):
    def __init__(self, model_path: str, dtype: str = "auto", device: str = "auto",
                 max_total_tokens: int | None = None, page_size: int = 1,
                 max_running_requests: int = 256, chunked_prefill_size: int = 2048,
                 schedule_policy: str = "lpm", attention_backend: str = "auto",
                 enable_prefix_cache: bool = True, seed: int = 0, deterministic: bool = False,
                 **kwargs: Any):
        model_config = ModelConfig.from_path(model_path)
        self.config = EngineConfig(
            model_path=model_path, dtype=dtype, device=device, max_total_tokens=max_total_tokens,
            page_size=page_size, max_running_requests=max_running_requests,
            chunked_prefill_size=chunked_prefill_size, schedule_policy=schedule_policy,
            attention_backend=attention_backend, enable_prefix_cache=enable_prefix_cache,
            seed=seed, deterministic=deterministic, **kwargs).resolve(model_config)
        self.config, self.launch = resolve_launch(self.config)
        if model_config.num_labels and self.config.tp_size > 1:
            raise ValueError("a reward model runs with tp_size=1 (its score head is not sharded)")
        self.model_config = model_config
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.runner = in_own_thread(lambda: make_runner(self.config, model_config))
        self.outputs = OutputProcessor(self.tokenizer, self._eos_ids(),
                                       self.config.context_length)
        self.loras = LoRAManager(self.config, model_config, self.runner.device,
                                 self.runner.dtype)
        serving = ServingVersion()
        self.scheduler = Scheduler(self.config, self.runner, self.outputs, serving, self.loras)
        self.weights = WeightManager(self.runner, self.scheduler, serving)
        self.loras.attach(self.scheduler)
        self.requests = RequestBuilder(
            self.tokenizer, model_config.vocab_size, self.config.context_length,
            self.scheduler.grammars, lambda: self.runner.allocator.size, self._check_servable,
            self.loras.check_name, self.scheduler.sessions.known,
            self.config.enable_return_routed_experts, model_config.num_labels,
            self.config.served_model_name, model_config,
            None if model_config.vision is None else ImageProcessorConfig.for_engine(
                model_path, self.runner.model.vision_config.spatial_merge_size,
                self.config.image_min_pixels, self.config.image_max_pixels))
        self._init_roles()
        self.scheduler.start()
        # A process that ends without shutdown() would finalize while the scheduler thread (a
        # daemon) may be inside a step: the interpreter then ends that thread inside torch's C++
        # and the process aborts ("terminate called without an active exception").
        self._at_exit = functools.partial(_shutdown_if_alive, weakref.ref(self))
        atexit.register(self._at_exit)

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen_path = os.path.join(self.config.model_path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return ids

    def shutdown(self) -> None:
        atexit.unregister(self._at_exit)
        self._close_roles()
        self.scheduler.shutdown()
        self.weights.close()
        self.runner.shutdown()

    def _generate(self, request: GenerateRequest) -> dict | list[dict] | Iterator[dict]:
        self._check_role("generate", "prefill")
        reqs, single = self.requests.build(request)
        return self._run(reqs, single, request.stream)

    def _run(self, reqs: list[Req], single: bool, stream: bool
             ) -> dict | list[dict] | Iterator[dict]:
        events: queue.Queue[dict] = queue.Queue()
        for req in reqs:
            req.sink = events.put
        self.scheduler.submit(reqs)
        if stream:
            return self._stream(reqs, events.get)
        finals = {}
        while len(finals) < len(reqs):
            out = events.get()
            finals[out["meta_info"]["id"]] = out
        outs = [finals[r.rid] for r in reqs]
        return outs[0] if single else outs

    def _stream(self, reqs: list[Req], get: Callable[[], dict]) -> Iterator[dict]:
        done = 0
        try:
            while done < len(reqs):
                event = get()
                done += event["meta_info"]["finish_reason"] is not None
                yield event
        finally:
            for req in reqs:
                if not req.finished:
                    self.abort_request(req.rid)

    async def _async_generate(self, request: GenerateRequest
                              ) -> dict | list[dict] | AsyncIterator[dict]:
        self._check_role("generate", "prefill")
        reqs, single = self.requests.build(request)
        events = self._submit_async(reqs)
        if request.stream:
            return self._astream(reqs, events)
        return await self._gather(reqs, single, events)

    def _submit_async(self, reqs: list[Req]) -> asyncio.Queue[dict]:
        """Submit `reqs`; their outputs arrive on the returned queue, in the caller's loop."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict] = asyncio.Queue()
        for req in reqs:
            req.sink = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        self.scheduler.submit(reqs)
        return events

    async def _gather(self, reqs: list[Req], single: bool, events: asyncio.Queue[dict]
                      ) -> dict | list[dict]:
        """The final outputs of `reqs`, in order; the requests are aborted if the wait is."""
        finals = {}
        try:
            while len(finals) < len(reqs):
                out = await events.get()
                finals[out["meta_info"]["id"]] = out
        finally:
            for req in reqs:
                if not req.finished:
                    self.abort_request(req.rid)
        outs = [finals[r.rid] for r in reqs]
        return outs[0] if single else outs

    def _classify(self, request: ClassifyRequest) -> dict | list[dict]:
        reqs, single = self.requests.build_classify(request)
        return self._run(reqs, single, False)

    async def _async_classify(self, request: ClassifyRequest) -> dict | list[dict]:
        reqs, single = self.requests.build_classify(request)
        return await self._gather(reqs, single, self._submit_async(reqs))

    async def _astream(self, reqs: list[Req], events: asyncio.Queue) -> AsyncIterator[dict]:
        done = 0
        try:
            while done < len(reqs):
                event = await events.get()
                done += event["meta_info"]["finish_reason"] is not None
                yield event
        finally:
            for req in reqs:
                if not req.finished:
                    self.abort_request(req.rid)

    def _check_servable(self) -> None:
        self.weights.check_servable()
        self.runner.check_alive()

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.scheduler.abort(rid, abort_all)

    def pause_generation(self, mode: str = "retract") -> dict:
        return self.weights.pause_generation(check_pause_mode(mode, "mode"))

    def continue_generation(self) -> dict:
        """Commits an update that holds generation first (slime pauses, pushes buckets,
        continues)."""
        committed = ""
        if self._holding_update():
            out = self.commit_weight_update()
            if not out["success"]:
                return out
            committed = "; " + out["message"]
        out = self.scheduler.resume()
        return {**out, "message": out["message"] + committed}

    def flush_cache(self, timeout_s: float | None = None) -> dict:
        """Commits an update that holds generation first: SGLang trainers end a bucketed update
        with it."""
        if self._holding_update():
            committed = self.commit_weight_update()
            if not committed["success"]:
                return committed
        return self.scheduler.flush_cache(timeout_s)

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Free "weights" (with the LoRA pool's buffers) and/or "kv_cache" memory (None: both)
        while nothing is queued or running, e.g. while a colocated trainer trains. Released
        weights lose their values (adapters keep theirs on the host):
        after resume_memory_occupation, generation is refused until an update rewrites every
        tensor. Requests sent while the KV cache is released wait for its resume."""
        tags = memory_tags(tags)
        return self.scheduler.run(lambda: self._release_memory(tags))

    def _release_memory(self, tags: list[str]) -> dict:
        # Scheduler thread: nothing may be admitted between the scheduler's check and the
        # weights' release.
        self.weights.check_none_open("releasing memory")
        out = self.scheduler.release_memory(tags)
        if out["success"] and "weights" in tags:
            self.weights.release_weights()
            self.loras.pool.release()
        return out

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        tags = memory_tags(tags)
        return self.scheduler.run(lambda: self._resume_memory(tags))

    def _resume_memory(self, tags: list[str]) -> dict:
        if "weights" in tags:
            self.weights.resume_weights()
            self.loras.pool.resume()
        return self.scheduler.resume_memory(tags)

    def get_weight_version(self) -> str:
        return self.weights.version

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    def _check_update(self, model: str | None) -> None:
        """Every update method asks this first: whether an update addressed to `model` may
        change these weights (a frozen engine's updates must name it)."""
        check_update_model(self.model_name, self.config.frozen, model)

    def _holding_update(self) -> bool:
        update = self.weights.open_update
        return update is not None and update.holds_generation

    # Every update route is a thin call onto one weight-update transaction (engine/weights/).
    # `flush_cache` on the update calls only decides what commit=None means (resolve_commit):
    # every commit retires all KV of older versions and frees it, so a flush has nothing to drop.

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, *, weight_version: str | None = None,
                                   pause_mode: str = "retract", commit: bool | None = None,
                                   model: str | None = None) -> dict:
        """Names HF's loader ignores (rotary_emb.inv_freq) are accepted and skipped. With
        commit=False the update holds generation and keeps the version until
        commit_weight_update() (or a later call that commits) makes it one version. With
        load_format="delta", named_tensors is a hotswap.weight_sync.Delta (a DeltaTracker's)."""
        self._check_update(model)
        _check_direct_format(load_format, named_tensors)
        return self.weights.update_from_tensor(named_tensors, weight_version, pause_mode,
                                               resolve_commit(commit, flush_cache))

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None, *,
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 pause_mode: str = "retract", commit: bool | None = None,
                                 model: str | None = None) -> dict:
        self._check_update(model)
        if load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {load_format!r}: checkpoints load as safetensors")
        return self.weights.update_from_disk(model_path, weight_version, pause_mode,
                                             resolve_commit(commit, flush_cache))

    def update_weights_from_serialized(self, serialized_named_tensors: list[str],
                                       load_format: str | None = None, flush_cache: bool = True,
                                       *, weight_version: str | None = None,
                                       pause_mode: str = "retract",
                                       commit: bool | None = None,
                                       model: str | None = None) -> dict:
        """Every entry is applied (SGLang sends one per trainer rank)."""
        self._check_update(model)
        if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
            raise ValueError("serialized_named_tensors must be a non-empty list of strings")
        _check_direct_format(None if load_format == "flattened_bucket" else load_format)
        named: dict[str, Any] = {}
        for data in serialized_named_tensors:
            named.update(deserialize_named_tensors(data))
        return self.update_weights_from_tensor(
            named, None, flush_cache, weight_version=weight_version, pause_mode=pause_mode,
            commit=commit, model=model)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False, *,
                              model: str | None = None) -> dict:
        """Relabel the serving weights (SGLang's route): new requests and their cache namespace
        use the new label; the weights do not change."""
        self._check_update(model)
        if not isinstance(new_version, str) or not new_version:
            raise ValueError("new_version must be a non-empty string")
        return self.scheduler.run(lambda: self.weights.relabel(new_version, abort_all_requests))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "auto") -> dict:
        return self.weights.init_group(master_address, master_port, rank_offset, world_size,
                                       group_name, backend)

    @property
    def weights_dtype(self) -> str:
        """The dtype the weights are kept in: what a delta update carries (DeltaTracker)."""
        return self.config.dtype

    @property
    def weight_sync_ranks(self) -> int:
        """Ranks this engine takes in a trainer's weight-update group: one per TP rank, at
        rank_offset + tp_rank (a WeightSender counts them into its world size)."""
        return self.config.tp_size

    def _update_weights_from_distributed(self, update: DistributedUpdate) -> dict:
        """With lora_name: the names are that adapter's PEFT names and the broadcast replaces
        it (bumping its version); the base weights and their version are untouched, so the
        base update's arguments (weight_version, commit, flush_cache=False, staging) are
        refused. staging: where base weights land (docs/api.md#where-an-update-lands)."""
        u = update
        self._check_broadcast_update(u)
        if u.lora_name is not None:
            return self.loras.update_from_distributed(
                u.lora_name, self.weights.group(u.group_name), *u.tensors(), u.load_format,
                u.pause_mode)
        return self.weights.update_from_distributed(
            *u.tensors(), u.group_name, u.weight_version, u.pause_mode, u.load_format,
            resolve_commit(u.commit, u.flush_cache), u.staging)

    def _check_broadcast_update(self, u: DistributedUpdate) -> None:
        """The checks a broadcast update passes before it is received; a refused one still
        takes part in the broadcast (if joined), so the sender and the other targets finish."""
        try:
            self._check_update(u.model)
            if u.lora_name is not None:
                _check_adapter_update(u.weight_version, u.commit, u.flush_cache, u.staging)
                self._check_lora_supported()
        except ValueError:
            with contextlib.suppress(ValueError):
                self.weights.discard(self.weights.group(u.group_name), *u.tensors(),
                                     u.load_format)
            raise

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self.weights.destroy_group(group_name)

    # Two phases for coordinators of several engines (WeightSender, Router, RayFleet): a
    # prepare call receives and validates beside the serving weights; commit or abort follows.

    def _prepare_weights_from_distributed(self, update: DistributedUpdate) -> dict:
        self._check_broadcast_update(update)
        return self.weights.prepare_from_distributed(*update.tensors(), update.group_name,
                                                     update.load_format)

    def prepare_weights_from_disk(self, model_path: str, *, model: str | None = None) -> dict:
        self._check_update(model)
        return self.weights.prepare_from_disk(model_path)

    def prepare_weights_from_tensor(self, named_tensors: Any, *,
                                    model: str | None = None) -> dict:
        """(HF name, tensor) pairs in hand (a Ray fleet's object store), kept by reference, or
        a Delta (hotswap.weight_sync)."""
        self._check_update(model)
        return self.weights.prepare_from_tensor(named_tensors)

    def commit_weight_update(self, weight_version: str | None = None,
                             pause_mode: str | None = None) -> dict:
        """The open update (prepared, or pieces sent with commit=False) becomes one version;
        ValueError when none is open. pause_mode: a prepared update's (default "retract");
        pieces paused generation with their own when the first arrived."""
        return self.weights.commit(weight_version, pause_mode)

    def abort_weight_update(self) -> dict:
        """Drop the open update: nothing changes, unless pieces were already written in place
        (commit=False): then generation is refused until a complete update succeeds."""
        return self.weights.abort()

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self.weights.get_weights_by_name(name, truncate_size)

    def load_lora_adapter(self, lora_name: str, lora_path: str, *,
                          pause_mode: str = "retract") -> dict:
        """Load (or replace) an adapter from a PEFT folder; bumps its version."""
        self._check_lora_supported()
        return self.loras.load_from_path(lora_name, lora_path, pause_mode)

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict,
                                       *, pause_mode: str = "retract") -> dict:
        """tensors: PEFT name -> tensor (dict or pairs); config_dict: adapter_config.json."""
        self._check_lora_supported()
        return self.loras.load_from_tensors(lora_name, tensors, config_dict, pause_mode)

    def _check_lora_supported(self) -> None:
        if self.config.tp_size > 1:
            raise ValueError(f"LoRA adapters are not available with tp_size="
                             f"{self.config.tp_size} (adapter deltas are not sharded over "
                             "tensor-parallel ranks); use tp_size=1")

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self.loras.unload(lora_name)

    def list_lora_adapters(self) -> dict[str, int]:
        """Loaded adapters and their versions."""
        return {name: a.version for name, a in self.loras.adapters.items()}

    def open_session(self, ttl_s: float = 300.0, session_id: str | None = None) -> str:
        """Open a session (a conversation) and return its id: each turn sent with
        `session_id=` leaves its KV pinned in the prefix cache, so the next turn prefills only
        its new tokens, until the session is closed, goes `ttl_s` seconds without a turn, is
        pushed out by newer sessions' pins (session_budget_fraction of the KV pool), or a
        weight update retires that KV."""
        return self.scheduler.open_session(ttl_s, session_id)

    def close_session(self, session_id: str) -> bool:
        """Close a session and free its pin; False when no such session is open."""
        return self.scheduler.close_session(session_id)

    def get_load(self) -> dict[str, Any]:
        """Requests running, waiting, forked and compiling, KV tokens used, cached and in the
        pool, and running token totals; read at once, without waiting for a step."""
        return self.scheduler.load().to_dict()

    def check_integrity(self) -> None:
        """Invariant 2 (conservation) and the tree's own checks, run in the scheduler thread."""
        self.scheduler.check_integrity()



def _check_adapter_update(weight_version: str | None, commit: bool | None, flush_cache: bool,
                          staging: str | None) -> None:
    given = [name for name, value in (("weight_version", weight_version), ("commit", commit),
                                      ("staging", staging)) if value is not None]
    if flush_cache is not True:
        given.append("flush_cache")
    if given:
        raise ValueError(f"{', '.join(given)}: not for an adapter update (lora_name is set); "
                         "the adapter is replaced at once, under its own version")


def _check_direct_format(load_format: str | None, named_tensors: Any = None) -> None:
    if (load_format == "delta") != isinstance(named_tensors, Delta):
        raise ValueError('load_format="delta" goes with a Delta (hotswap.weight_sync), and a '
                         "Delta with it")
    if load_format == "delta":
        return
    # SGLang's other formats carry handles or buckets that its adapter unpacks first.
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format {load_format!r}: the Engine takes named tensors "
                         "(None); hotswap.trainers_adapters.sglang unpacks flattened buckets")


def _shutdown_if_alive(ref: weakref.ref[Engine]) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()
