"""Engine: the in-process API (API.md section 1) over the scheduler thread."""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from transformers import AutoTokenizer

from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.core.request import Req
from hotswap.engine.core.sampling_params import SamplingParams
from hotswap.engine.distributed.launch import make_runner, resolve_launch
from hotswap.engine.lora.manager import LoRAManager
from hotswap.engine.scheduler.output import OutputProcessor
from hotswap.engine.scheduler.scheduler import Scheduler
from hotswap.engine.weights.prepared import PreparedUpdate
from hotswap.engine.weights.weight_manager import PAUSE_MODES, WeightManager
from hotswap.weight_sync.serialize import deserialize_named_tensors

_MEMORY_TAGS = ("weights", "kv_cache")


class Engine:
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
        self.model_config = model_config
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.runner = _in_own_thread(lambda: make_runner(self.config, model_config))
        self.weights = WeightManager(self.runner)
        self.outputs = OutputProcessor(self.tokenizer, self._eos_ids(),
                                       self.config.context_length)
        self.loras = LoRAManager(self.config, model_config, self.runner.device,
                                 self.runner.dtype)
        self.scheduler = Scheduler(self.config, self.runner, self.outputs,
                                   lambda: self.weights.version, self.loras)
        self.weights.attach(self.scheduler)
        self.prepared = PreparedUpdate(self.weights)
        self.loras.attach(self.scheduler)
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

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        atexit.unregister(self._at_exit)
        self.scheduler.shutdown()
        self.weights.close()
        if hasattr(self.runner, "shutdown"):  # tensor parallel: stop the worker processes
            self.runner.shutdown()

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, *,
                 messages: list[dict] | list[list[dict]] | None = None,
                 return_logprob: bool = False,
                 top_logprobs_num: int = 0, lora_name: str | list[str] | None = None,
                 cache_salt: str | list[str] | None = None, rid: str | list[str] | None = None,
                 stream: bool = False) -> dict | list[dict] | Iterator[dict]:
        """Outputs in the order given, samples of a prompt adjacent; a dict for one prompt, n=1."""
        reqs, single = self._make_requests(prompt, input_ids, messages, sampling_params,
                                           return_logprob, top_logprobs_num, lora_name,
                                           cache_salt, rid, stream)
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

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, *,
                             messages: list[dict] | list[list[dict]] | None = None,
                             return_logprob: bool = False, top_logprobs_num: int = 0,
                             lora_name: str | list[str] | None = None,
                             cache_salt: str | list[str] | None = None,
                             rid: str | list[str] | None = None,
                             stream: bool = False) -> dict | list[dict] | AsyncIterator[dict]:
        reqs, single = self._make_requests(prompt, input_ids, messages, sampling_params,
                                           return_logprob, top_logprobs_num, lora_name,
                                           cache_salt, rid, stream)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict] = asyncio.Queue()
        for req in reqs:
            req.sink = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        self.scheduler.submit(reqs)
        if stream:
            return self._astream(reqs, events)
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

    def _make_requests(self, prompt: Any, input_ids: Any, messages: Any, sampling_params: Any,
                       return_logprob: bool, top_logprobs_num: int, lora_name: Any,
                       cache_salt: Any, rid: Any, stream: bool) -> tuple[list[Req], bool]:
        """Validate and tokenize everything first: a bad input raises before anything runs."""
        self.weights.check_servable()
        self.runner.check_alive()
        prompts, single = self._prompt_ids(prompt, input_ids, messages)
        count = len(prompts)
        params = _per_prompt(sampling_params, count, "sampling_params", dict)
        salts = _per_prompt(cache_salt, count, "cache_salt", str)
        loras = _per_prompt(lora_name, count, "lora_name", str)
        rids = _per_prompt(rid, count, "rid", str)
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 100:
            raise ValueError("top_logprobs_num must be an integer in [0, 100]")
        if len(set(r for r in rids if r is not None)) < sum(r is not None for r in rids):
            raise ValueError("rid values must be unique")
        reqs = []
        for ids, p, salt, lora, r in zip(prompts, params, salts, loras, rids):
            sp = SamplingParams.from_dict(p)
            self._check_request(ids, sp, lora)
            grammar_job = self.scheduler.grammars.request_grammar(sp)  # ValueError if bad
            base = r or uuid.uuid4().hex
            leader = None
            for k in range(sp.n):
                reqs.append(Req(
                    rid=base if sp.n == 1 else f"{base}-{k}", prompt_ids=ids,
                    params=sp.for_sample(k), return_logprob=return_logprob,
                    top_logprobs_num=top_logprobs_num, cache_salt=salt, lora_name=lora,
                    stream=stream, group_leader=leader, created=time.perf_counter(),
                    grammar=self.scheduler.grammars.for_sample(grammar_job)))
                leader = leader or reqs[-1]
        return reqs, single and len(reqs) == 1

    def _prompt_ids(self, prompt: Any, input_ids: Any, messages: Any
                    ) -> tuple[list[list[int]], bool]:
        given = [x is not None for x in (prompt, input_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids, messages")
        if prompt is not None:
            if isinstance(prompt, str):
                return [self._encode(prompt)], True
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                return [self._encode(p) for p in prompt], False
            raise ValueError("prompt must be a non-empty str or a non-empty list of str")
        if input_ids is not None:
            if isinstance(input_ids, list) and input_ids and all(
                    isinstance(t, int) for t in input_ids):
                return [list(input_ids)], True
            if isinstance(input_ids, list) and input_ids and all(
                    isinstance(x, list) and all(isinstance(t, int) for t in x)
                    for x in input_ids):
                return [list(x) for x in input_ids], False
            raise ValueError("input_ids must be a non-empty list of int or a list of such lists")
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            return [self._chat(messages)], True
        if isinstance(messages, list) and messages and all(
                isinstance(c, list) and c and all(isinstance(m, dict) for m in c)
                for c in messages):
            return [self._chat(c) for c in messages], False
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, "
                         "or a list of such lists")

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise ValueError("prompt is empty")
        return self.tokenizer.encode(text)

    def _chat(self, conversation: list[dict]) -> list[int]:
        for m in conversation:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string 'role' and a string 'content'")
        if self.tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; use prompt=")
        ids = self.tokenizer.apply_chat_template(conversation, tokenize=True,
                                                 add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _check_request(self, ids: list[int], sp: SamplingParams, lora: str | None) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"input_ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        context = self.config.context_length
        if len(ids) >= context:
            raise ValueError(f"prompt has {len(ids)} tokens; the context length is {context}")
        if len(ids) + 1 > self.runner.allocator.size:
            raise ValueError(f"prompt has {len(ids)} tokens; the KV pool holds "
                             f"{self.runner.allocator.size}")
        sp.check_vocab(vocab)
        self.loras.check_name(lora)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.scheduler.abort(rid, abort_all)

    def pause_generation(self, mode: str = "retract") -> dict:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        out = self.scheduler.pause(mode)
        if self.weights.stage is not None:  # the user's pause outlives the staged update
            self.weights.stage.was_paused = True
        return out

    def continue_generation(self) -> dict:
        """Commits a staged weight update first (slime pauses, pushes buckets, continues)."""
        committed = ""
        if self.weights.stage is not None:
            out = self.commit_weight_update()
            if not out["success"]:
                return out
            committed = "; " + out["message"]
        out = self.scheduler.resume()
        return {**out, "message": out["message"] + committed}

    def flush_cache(self, timeout_s: float | None = None) -> dict:
        """Commits a staged weight update first: SGLang trainers end a bucketed update with it."""
        if self.weights.stage is not None:
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
        tags = _memory_tags(tags)
        return self.scheduler.run(lambda: self._release_memory(tags))

    def _release_memory(self, tags: list[str]) -> dict:
        # Scheduler thread: nothing may be admitted between the scheduler's check and the
        # weights' release.
        if self.weights.stage is not None:
            return {"success": False, "message": "a staged weight update is open; commit or "
                    "abort it before releasing memory"}
        out = self.scheduler.release_memory(tags)
        if out["success"] and "weights" in tags:
            self.weights.release_weights()
            self.loras.pool.release()
        return out

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        tags = _memory_tags(tags)
        return self.scheduler.run(lambda: self._resume_memory(tags))

    def _resume_memory(self, tags: list[str]) -> dict:
        if "weights" in tags:
            self.weights.resume_weights()
            self.loras.pool.resume()
        return self.scheduler.resume_memory(tags)

    def get_weight_version(self) -> str:
        return self.weights.version

    # `flush_cache`, on the update calls (and in the server's bodies and RemoteEngine), is
    # accepted for SGLang's positional order and otherwise ignored: every commit retires all KV
    # of older versions and frees it at once, so there is nothing left for a flush to drop.

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, *, weight_version: str | None = None,
                                   pause_mode: str = "retract", commit: bool = True) -> dict:
        """named_tensors: (HF name, tensor) pairs or a dict; a subset of the weights is fine.
        Names HF's loader ignores (rotary_emb.inv_freq) are accepted and skipped.
        commit=False stages the tensors: generation is held and the version stays until
        commit_weight_update() (or a later call with commit=True) makes them one version."""
        _check_direct_format(load_format)
        return self.weights.update_from_tensor(named_tensors, weight_version, pause_mode, commit)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None, *,
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 pause_mode: str = "retract", commit: bool = True) -> dict:
        if load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {load_format!r}: checkpoints load as safetensors")
        return self.weights.update_from_disk(model_path, weight_version, pause_mode, commit)

    def update_weights_from_serialized(self, serialized_named_tensors: list[str],
                                       load_format: str | None = None, flush_cache: bool = True,
                                       *, weight_version: str | None = None,
                                       pause_mode: str = "retract",
                                       commit: bool | None = None) -> dict:
        """HTTP's /update_weights_from_tensor: base64 safetensors (one entry per rank in SGLang;
        every entry is applied). commit=None commits when flush_cache is true, as SGLang's
        trainers send flush_cache=False on every bucket but the last."""
        if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
            raise ValueError("serialized_named_tensors must be a non-empty list of strings")
        _check_direct_format(None if load_format == "flattened_bucket" else load_format)
        named: dict[str, Any] = {}
        for data in serialized_named_tensors:
            named.update(deserialize_named_tensors(data))
        return self.update_weights_from_tensor(
            named, None, flush_cache, weight_version=weight_version, pause_mode=pause_mode,
            commit=flush_cache if commit is None else commit)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        """Relabel the serving weights (SGLang's route): new requests and their cache namespace
        use the new label; the weights do not change."""
        if not isinstance(new_version, str) or not new_version:
            raise ValueError("new_version must be a non-empty string")
        return self.scheduler.run(lambda: self.weights.relabel(new_version, abort_all_requests))

    def commit_weight_update(self, weight_version: str | None = None) -> dict:
        """Commit the staged update (commit=False calls) as one version; a no-op without one."""
        return self.scheduler.run(lambda: self.weights.commit_stage(weight_version))

    def abort_weight_update(self) -> dict:
        """Drop the staged update. If it wrote tensors, generation is refused until a complete
        update succeeds (the weights are half a version)."""
        return self.scheduler.run(self.weights.abort_stage)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "auto") -> dict:
        return self.weights.init_group(master_address, master_port, rank_offset, world_size,
                                       group_name, backend)

    @property
    def weight_sync_ranks(self) -> int:
        """Ranks this engine takes in a trainer's weight-update group: one per TP rank, at
        rank_offset + tp_rank (a WeightSender counts them into its world size)."""
        return self.config.tp_size

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True,
                                        load_format: str | None = None, *,
                                        weight_version: str | None = None,
                                        pause_mode: str = "retract",
                                        commit: bool = True,
                                        lora_name: str | None = None) -> dict:
        """With lora_name: the names are that adapter's PEFT names and the broadcast replaces
        it (bumping its version); the base weights and their version are untouched."""
        if lora_name is not None:
            group = self.weights.group(group_name)
            if self.config.tp_size > 1:  # take part in the broadcast, so the sender finishes
                self.weights.discard(group, names, dtypes, shapes, load_format)
                self._check_lora_supported()
            return self.loras.update_from_distributed(
                lora_name, group, names, dtypes, shapes, load_format, pause_mode)
        return self.weights.update_from_distributed(names, dtypes, shapes, group_name,
                                                    weight_version, pause_mode,
                                                    load_format, commit)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self.weights.destroy_group(group_name)

    # Two-phase updates for coordinators of several engines (WeightSender, Router): prepare
    # receives and validates into staging while serving goes on; commit or abort follows.

    def prepare_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                         shapes: list[list[int]],
                                         group_name: str = "weight_update_group",
                                         load_format: str | None = None) -> dict:
        return self.prepared.from_distributed(names, dtypes, shapes, group_name, load_format)

    def prepare_weights_from_disk(self, model_path: str) -> dict:
        return self.prepared.from_disk(model_path)

    def commit_weights_update(self, weight_version: str | None = None,
                              pause_mode: str = "retract") -> dict:
        return self.prepared.commit(weight_version, pause_mode)

    def abort_weights_update(self) -> dict:
        return self.prepared.abort()

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

    def check_integrity(self) -> None:
        """Invariant 2 (conservation) and the tree's own checks, run in the scheduler thread."""
        self.scheduler.check_integrity()



def _check_direct_format(load_format: str | None) -> None:
    # SGLang's other formats carry handles or buckets that its adapter unpacks first.
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format {load_format!r}: the Engine takes named tensors "
                         "(None); hotswap.trainers_adapters.sglang unpacks flattened buckets")


def _memory_tags(tags: list[str] | None) -> list[str]:
    if tags is None:
        return list(_MEMORY_TAGS)
    if not isinstance(tags, list) or not tags or any(t not in _MEMORY_TAGS for t in tags):
        raise ValueError(f"tags must be a non-empty list drawn from {list(_MEMORY_TAGS)}")
    return tags


def _shutdown_if_alive(ref: weakref.ref[Engine]) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()


def _in_own_thread(fn: Callable[[], Any]) -> Any:
    """Run fn in a short-lived thread: its OpenMP workers exit with it.

    Every thread that runs parallel torch ops keeps its own OpenMP team. With more workers alive
    than cores libgomp stops spinning between parallel regions, and each small op in the
    scheduler thread pays a futex wake-up (measured: a [64, 576] mul took 47 us instead of
    4 us; a SmolLM2 decode step at batch 64, 193 ms instead of 160 ms). Loading the model here,
    not in the caller's thread, keeps the scheduler's team the only one.
    """
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=run, name="hotswap-load")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def _per_prompt(value: Any, count: int, name: str, kind: type) -> list[Any]:
    if value is None or isinstance(value, kind):
        return [value] * count
    if isinstance(value, list) and len(value) == count and all(
            v is None or isinstance(v, kind) for v in value):
        return list(value)
    raise ValueError(f"{name} must be a {kind.__name__} or a list of {count} of them")
