"""Router: several `python -m hotswap.engine.server` processes as one EngineClient.

Requests go where their longest prompt prefix was served (that server holds its KV), unless
that server is much busier than the least loaded one or the match is short; then the least
loaded server takes it. Weight updates reach every server and end on one version or on none:
one-call updates prepare on every server and commit only when all prepared; staged updates
(commit=False) stage on every server, and the first server's commit picks the version the others
commit. Every other control call goes to every server. docs/fleet.md#router says more.

`create_router_app(router)` (router_app.py) is its HTTP front; `python -m hotswap.fleet` runs it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hotswap.engine.client.protocol import EngineClient, resolve_commit
from hotswap.engine.client.remote import RemoteEngine
from hotswap.fleet.affinity import Key, PrefixAffinity, affinity_key
from hotswap.weight_sync.sender import agreed_version
from hotswap.weight_sync.serialize import serialize_named_tensors

_DOWN_FOR_S = 5.0  # a server that refused a connection is skipped this long


class ServersDisagree(RuntimeError):
    """Servers that should hold the same state (version, weights, adapters) do not."""


class Router(EngineClient):
    def __init__(self, urls: Sequence[str], api_key: str | None = None,
                 admin_key: str | None = None, cache_threshold: float = 0.5,
                 balance_abs: int = 16, balance_rel: float = 2.0,
                 timeout_s: float | None = None):
        """cache_threshold: the matched share of a prompt that routes it to the server that
        has it; balance_abs / balance_rel: when the busiest server has that many more (and that
        many times as many) requests in flight as the idlest, routing ignores the cache."""
        if not urls or any(not isinstance(u, str) or not u for u in urls):
            raise ValueError("urls must be a non-empty list of server URLs")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError("urls repeats a server")
        self.api_key, self.admin_key = api_key, admin_key
        self.engines = [RemoteEngine(u, api_key, admin_key, timeout_s) for u in self.urls]
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.affinity = PrefixAffinity()
        self.inflight = [0] * len(self.urls)
        self.assigned = [0] * len(self.urls)
        self._down_until = [0.0] * len(self.urls)
        self._lock = threading.Lock()
        self._proposed: str | None = None

    def __repr__(self) -> str:
        return f"Router({self.urls!r})"

    def headers(self, admin: bool) -> dict[str, str]:
        """What this router presents to its servers (their keys are its keys)."""
        key = (self.admin_key or self.api_key) if admin else (self.api_key or self.admin_key)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def shutdown(self) -> None:
        """Closes the connections; the servers keep running."""
        for engine in self.engines:
            engine.shutdown()

    # routing

    def choose(self, key: Key) -> int:
        """The server for a prompt `key`; counts it in flight until `done(server)`."""
        with self._lock:
            now = time.monotonic()
            up = [i for i in range(len(self.urls)) if self._down_until[i] <= now]
            candidates = up or list(range(len(self.urls)))
            server = self._cached_choice(key, candidates)
            if server is None:
                server = min(candidates, key=lambda i: (self.inflight[i], self.assigned[i], i))
            self.inflight[server] += 1
            self.assigned[server] += 1
            self.affinity.insert(key, server)
            return server

    def _cached_choice(self, key: Key, candidates: list[int]) -> int | None:
        loads = [self.inflight[i] for i in candidates]
        if (max(loads) - min(loads) > self.balance_abs
                and max(loads) > self.balance_rel * min(loads)):
            return None  # imbalanced: spread the load first
        matches = {i: n for i, n in self.affinity.match(key).items() if i in candidates}
        if not matches or not key:
            return None
        server = max(matches, key=lambda i: (matches[i], -self.inflight[i]))
        return server if matches[server] / len(key) >= self.cache_threshold else None

    def done(self, server: int) -> None:
        with self._lock:
            self.inflight[server] -= 1

    def mark_down(self, server: int) -> None:
        with self._lock:
            self._down_until[server] = time.monotonic() + _DOWN_FOR_S

    def least_loaded(self) -> int:
        with self._lock:
            return min(range(len(self.urls)), key=lambda i: (self.inflight[i], i))

    # generation: a call's prompts go to one server, chosen by the first prompt

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, *,
                 messages: list | None = None, return_logprob: bool = False,
                 top_logprobs_num: int = 0, lora_name: str | list[str | None] | None = None,
                 cache_salt: str | list[str | None] | None = None,
                 rid: str | list[str | None] | None = None,
                 stream: bool = False) -> dict | list[dict] | Iterator[dict]:
        kwargs = dict(locals())
        del kwargs["self"]
        server = self.choose(affinity_key("/generate", kwargs))
        try:
            out = self.engines[server].generate(**kwargs)
        except BaseException:
            self.done(server)
            raise
        if stream:
            return self._counted(out, server)
        self.done(server)
        return out

    def _counted(self, events: Iterator[dict], server: int) -> Iterator[dict]:
        try:
            yield from events
        finally:
            self.done(server)

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, *,
                             messages: list | None = None, return_logprob: bool = False,
                             top_logprobs_num: int = 0,
                             lora_name: str | list[str | None] | None = None,
                             cache_salt: str | list[str | None] | None = None,
                             rid: str | list[str | None] | None = None,
                             stream: bool = False) -> dict | list[dict] | AsyncIterator[dict]:
        kwargs = dict(locals())
        del kwargs["self"]
        server = self.choose(affinity_key("/generate", kwargs))
        try:
            out = await self.engines[server].async_generate(**kwargs)
        except BaseException:
            self.done(server)
            raise
        if stream:
            return self._acounted(out, server)
        self.done(server)
        return out

    async def _acounted(self, events: AsyncIterator[dict], server: int) -> AsyncIterator[dict]:
        try:
            async for event in events:
                yield event
        finally:
            self.done(server)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self._combined(self.fan_out(lambda e: e.abort_request(rid, abort_all)), "abort")

    # serving state: every server

    def pause_generation(self, mode: str = "retract") -> dict:
        return self._combined(self.fan_out(lambda e: e.pause_generation(mode)), "paused")

    def continue_generation(self) -> dict:
        return self._combined(self.fan_out(lambda e: e.continue_generation()), "continued")

    def flush_cache(self, timeout_s: float | None = None) -> dict:
        return self._combined(self.fan_out(lambda e: e.flush_cache(timeout_s)), "flushed")

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._combined(self.fan_out(lambda e: e.release_memory_occupation(tags)),
                              "released")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._combined(self.fan_out(lambda e: e.resume_memory_occupation(tags)),
                              "resumed")

    def check_integrity(self) -> None:
        failed = self.failures(self.fan_out(lambda e: e.check_integrity()))
        if failed:
            raise AssertionError(f"integrity check failed on {failed}")

    # weights: reads that every server must answer alike

    def get_weight_version(self) -> str:
        return self._same(self.fan_out(lambda e: e.get_weight_version()), "weight version")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self._same(self.fan_out(lambda e: e.get_weights_by_name(name, truncate_size)),
                          f"values of {name!r}")

    def list_lora_adapters(self) -> dict[str, int]:
        return self._same(self.fan_out(lambda e: e.list_lora_adapters()), "LoRA adapters")

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        return self._combined(self.fan_out(
            lambda e: e.update_weight_version(new_version, abort_all_requests)),
            f"relabelled {new_version!r}")

    # weights: updates, on every server or on none

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, *, weight_version: str | None = None,
                                   pause_mode: str = "retract",
                                   commit: bool | None = None) -> dict:
        return self.update_weights_from_serialized(
            [serialize_named_tensors(named_tensors)], load_format, flush_cache,
            weight_version=weight_version, pause_mode=pause_mode, commit=commit)

    def update_weights_from_serialized(self, serialized_named_tensors: list[str],
                                       load_format: str | None = None, flush_cache: bool = True,
                                       *, weight_version: str | None = None,
                                       pause_mode: str = "retract",
                                       commit: bool | None = None) -> dict:
        return self._staged(lambda e: e.update_weights_from_serialized(
            serialized_named_tensors, load_format, flush_cache, weight_version=weight_version,
            pause_mode=pause_mode, commit=False), resolve_commit(commit, flush_cache),
            weight_version)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None, *,
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 pause_mode: str = "retract", commit: bool | None = None) -> dict:
        if not resolve_commit(commit, flush_cache):
            return self._staged(lambda e: e.update_weights_from_disk(
                model_path, load_format, weight_version=weight_version, pause_mode=pause_mode,
                commit=False), False, weight_version)
        if load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {load_format!r}: checkpoints load as safetensors")
        return self._two_phase(lambda e: e.prepare_weights_from_disk(model_path),
                               weight_version, pause_mode)

    def commit_weight_update(self, weight_version: str | None = None) -> dict:
        # The first server picks the version (it knows its own history) and the rest follow.
        first = self.engines[0].commit_weight_update(weight_version)
        if not first.get("success"):
            self.abort_weight_update()
            return {**first, "message": f"{self.urls[0]}: {first.get('message')}; every "
                    "server aborted its staged update"}
        version = first["weight_version"]
        rest = self.fan_out_indexed(lambda i, e: first if i == 0 else
                                    e.commit_weight_update(version))
        return self._committed(rest, version)

    def abort_weight_update(self) -> dict:
        return self._combined(self.fan_out(lambda e: e.abort_weight_update()), "aborted")

    # weights: a trainer's process group

    @property
    def weight_sync_ranks(self) -> int:
        """What a WeightSender counts for this router: every server's ranks (its TP size)."""
        return sum(e.weight_sync_ranks for e in self.engines)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "auto") -> dict:
        """Server i joins at rank_offset + the ranks of the servers before it (one per server
        unless a server runs tensor parallel)."""
        offsets = [rank_offset + sum(e.weight_sync_ranks for e in self.engines[:i])
                   for i in range(len(self.engines))]
        results = self.fan_out_indexed(lambda i, e: e.init_weights_update_group(
            master_address, master_port, offsets[i], world_size, group_name, backend))
        return self._combined(results, f"joined {group_name!r}")

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True,
                                        load_format: str | None = None, *,
                                        weight_version: str | None = None,
                                        pause_mode: str = "retract",
                                        commit: bool | None = None,
                                        lora_name: str | None = None) -> dict:
        """Every server receives the one broadcast at once (they all hold ranks in it)."""
        if lora_name is not None:
            return self._combined(self.fan_out(lambda e: e.update_weights_from_distributed(
                names, dtypes, shapes, group_name, flush_cache, load_format,
                pause_mode=pause_mode, lora_name=lora_name)), f"updated adapter {lora_name!r}")
        if not resolve_commit(commit, flush_cache):
            return self._staged(lambda e: e.update_weights_from_distributed(
                names, dtypes, shapes, group_name, flush_cache, load_format,
                weight_version=weight_version, pause_mode=pause_mode, commit=False),
                False, weight_version)
        return self._two_phase(lambda e: e.prepare_weights_from_distributed(
            names, dtypes, shapes, group_name, load_format), weight_version, pause_mode)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        results = self.fan_out(lambda e: e.destroy_weights_update_group(group_name))
        return self._combined(results, f"destroyed {group_name!r}")

    # weights: two phases, the router itself a participant of a larger coordinator

    def prepare_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                         shapes: list[list[int]],
                                         group_name: str = "weight_update_group",
                                         load_format: str | None = None) -> dict:
        return self._prepare(lambda e: e.prepare_weights_from_distributed(
            names, dtypes, shapes, group_name, load_format))

    def prepare_weights_from_disk(self, model_path: str) -> dict:
        return self._prepare(lambda e: e.prepare_weights_from_disk(model_path))

    def commit_weights_update(self, weight_version: str | None = None,
                              pause_mode: str = "retract") -> dict:
        # One version for all: each server left to itself might pick a different next one.
        version = weight_version or self._proposed
        return self._committed(
            self.fan_out(lambda e: e.commit_weights_update(version, pause_mode)), version)

    def abort_weights_update(self) -> dict:
        return self._combined(self.fan_out(lambda e: e.abort_weights_update()), "aborted")

    # LoRA adapters: the same adapters everywhere

    def load_lora_adapter(self, lora_name: str, lora_path: str, *,
                          pause_mode: str = "retract") -> dict:
        return self._combined(self.fan_out(lambda e: e.load_lora_adapter(
            lora_name, lora_path, pause_mode=pause_mode)), f"loaded {lora_name!r}")

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict,
                                       *, pause_mode: str = "retract") -> dict:
        return self._combined(self.fan_out(lambda e: e.load_lora_adapter_from_tensors(
            lora_name, tensors, config_dict, pause_mode=pause_mode)), f"loaded {lora_name!r}")

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._combined(self.fan_out(lambda e: e.unload_lora_adapter(lora_name)),
                              f"unloaded {lora_name!r}")

    # all or none

    def _prepare(self, prepare: Callable[[RemoteEngine], dict]) -> dict:
        results = self.fan_out(prepare)
        failed = self.failures(results)
        if failed:
            self.fan_out(lambda e: e.abort_weights_update())
            message = f"update refused by {failed}; no server committed it"
            self._raise_bad_input(results, message)
            return {"success": False, "message": message, "weight_version": None}
        self._proposed = agreed_version(results)
        return {"success": True, "message": "prepared on every server",
                "weight_version": self._proposed}

    def _two_phase(self, prepare: Callable[[RemoteEngine], dict], weight_version: str | None,
                   pause_mode: str) -> dict:
        if weight_version is not None and (not isinstance(weight_version, str)
                                           or not weight_version):
            raise ValueError("weight_version must be a non-empty string")
        prepared = self._prepare(prepare)
        if not prepared["success"]:
            return prepared
        return self.commit_weights_update(weight_version, pause_mode)

    def _staged(self, stage: Callable[[RemoteEngine], dict], commit: bool,
                weight_version: str | None) -> dict:
        results = self.fan_out(stage)
        failed = self.failures(results)
        if failed:
            self.fan_out(lambda e: e.abort_weight_update())
            message = f"update refused by {failed}; no server committed it"
            self._raise_bad_input(results, message)
            return {"success": False, "weight_version": None, "message": message}
        if commit:
            return self.commit_weight_update(weight_version)
        return {**results[0], "message": f"staged on {len(self.urls)} servers"}

    def _committed(self, results: list[Any], version: str | None) -> dict:
        failed = self.failures(results)
        if failed:
            # Every server held the validated update; a commit fails only if a server died.
            return {"success": False, "weight_version": version, "message":
                    f"commit of {version!r} failed on {failed}; the other servers committed"}
        return {"success": True, "weight_version": version,
                "message": f"{len(self.urls)} servers updated to version {version!r}"}

    # fan-out helpers

    def fan_out(self, fn: Callable[[RemoteEngine], Any]) -> list[Any]:
        return self.fan_out_indexed(lambda _, e: fn(e))

    def fan_out_indexed(self, fn: Callable[[int, RemoteEngine], Any]) -> list[Any]:
        """fn on every server at once (a group rendezvous needs them all); a result or the
        exception it raised, per server."""
        def call(i: int) -> Any:
            try:
                return fn(i, self.engines[i])
            except Exception as exc:  # noqa: BLE001 - returned for the caller to report
                return exc

        with ThreadPoolExecutor(max_workers=len(self.engines)) as pool:
            return list(pool.map(call, range(len(self.engines))))

    def failures(self, results: list[Any]) -> dict[str, str]:
        failed = {}
        for url, result in zip(self.urls, results, strict=True):
            if isinstance(result, BaseException):
                failed[url] = f"{type(result).__name__}: {result}"
            elif isinstance(result, dict) and not result.get("success", True):
                failed[url] = str(result.get("message"))
        return failed

    @staticmethod
    def _raise_bad_input(results: list[Any], message: str) -> None:
        """Bad input is refused alike by every server: raised as the engine raises it."""
        errors = [r for r in results if isinstance(r, BaseException)]
        for kind in (ValueError, PermissionError):
            if errors and all(isinstance(e, kind) for e in errors):
                raise kind(message)

    def _combined(self, results: list[Any], what: str) -> dict:
        failed = self.failures(results)
        if failed:
            self._raise_bad_input(results, f"refused by {failed}")
            return {"success": False, "message": f"failed on {failed}"}
        return {"success": True, "message": f"{what} on {len(self.urls)} servers"}

    def _same(self, results: list[Any], what: str) -> Any:
        failed = self.failures(results)
        if failed:
            self._raise_bad_input(results, f"refused by {failed}")
            raise ServersDisagree(f"could not read the {what} of every server: {failed}")
        if any(r != results[0] for r in results):
            raise ServersDisagree(f"servers disagree on the {what}: "
                                  f"{dict(zip(self.urls, results, strict=True))}")
        return results[0]
