"""Router: a data-parallel front for several `python -m hotswap.engine.server` processes.

Requests go where their longest prompt prefix was served (that server holds its KV), unless
that server is much busier than the least loaded one or the match is short; then the least
loaded server takes it. Weight updates fan out in two phases: every server receives and
validates the update into staging (prepare), and only when all succeeded do they all commit,
on one version; on any failure every server aborts and keeps its old weights and version.

In Python, `Router(urls)` has the Engine's generation and weight methods; `router.app()` is its
HTTP front (the servers' routes passed through), and
`python -m hotswap.engine.server.router --urls URL URL --port 31000` runs that front.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hotswap.engine.client.remote import RemoteEngine
from hotswap.engine.server.affinity import Key, PrefixAffinity

_DOWN_FOR_S = 5.0  # a server that refused a connection is skipped this long


class Router:
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

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

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

    # generation (Python API; the HTTP front proxies instead)

    def generate(self, prompt: str | list[str] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 messages: list[dict] | list[list[dict]] | None = None,
                 sampling_params: dict | list[dict] | None = None, return_logprob: bool = False,
                 top_logprobs_num: int = 0, lora_name: str | list[str] | None = None,
                 cache_salt: str | list[str] | None = None, rid: str | list[str] | None = None,
                 stream: bool = False) -> dict | list[dict] | Iterator[dict]:
        """As Engine.generate; a batch goes to one server, chosen by its first prompt."""
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

    # weights: two phases over every server

    def get_weight_version(self) -> str:
        versions = self.fan_out(lambda e: e.get_weight_version())
        if any(isinstance(v, BaseException) for v in versions) or len(set(versions)) != 1:
            raise RuntimeError(f"servers disagree on the weight version: {self._named(versions)}")
        return versions[0]

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None, *,
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 pause_mode: str = "retract", commit: bool = True) -> dict:
        _one_version_only(commit)
        return self._two_phase(lambda e: e.prepare_weights_from_disk(model_path),
                               weight_version, pause_mode)

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
                                        pause_mode: str = "retract", commit: bool | None = True,
                                        lora_name: str | None = None) -> dict:
        _one_version_only(flush_cache if commit is None else commit)
        if lora_name is not None:
            raise ValueError("lora_name: adapter updates are not fanned out by the router yet; "
                             "send them to each server")
        return self._two_phase(lambda e: e.prepare_weights_from_distributed(
            names, dtypes, shapes, group_name, load_format), weight_version, pause_mode)

    def prepare_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                         shapes: list[list[int]],
                                         group_name: str = "weight_update_group",
                                         load_format: str | None = None) -> dict:
        results = self.fan_out(lambda e: e.prepare_weights_from_distributed(
            names, dtypes, shapes, group_name, load_format))
        failed = self.failures(results)
        if failed:
            self.fan_out(lambda e: e.abort_weights_update())
            raise ValueError(f"prepare refused by {failed}")
        self._proposed = agreed_version(results)
        return {"success": True, "message": "prepared on every server",
                "weight_version": self._proposed}

    def commit_weights_update(self, weight_version: str | None = None,
                              pause_mode: str = "retract") -> dict:
        # One version for all: each server left to itself might pick a different next one.
        weight_version = weight_version or self._proposed
        results = self.fan_out(lambda e: e.commit_weights_update(weight_version, pause_mode))
        return self._combined(results, f"committed {weight_version!r}")

    def abort_weights_update(self) -> dict:
        return self._combined(self.fan_out(lambda e: e.abort_weights_update()), "aborted")

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        results = self.fan_out(lambda e: e.destroy_weights_update_group(group_name))
        return self._combined(results, f"destroyed {group_name!r}")

    def _two_phase(self, prepare: Callable[[RemoteEngine], dict], weight_version: str | None,
                   pause_mode: str) -> dict:
        if weight_version is not None and (not isinstance(weight_version, str)
                                           or not weight_version):
            raise ValueError("weight_version must be a non-empty string")
        prepared = self.fan_out(prepare)
        failed = self.failures(prepared)
        if failed:
            self.fan_out(lambda e: e.abort_weights_update())
            message = f"update refused by {failed}; no server committed it"
            if all(isinstance(r, ValueError) for r in prepared if isinstance(r, BaseException)):
                raise ValueError(message)
            return {"success": False, "message": message, "weight_version": None}
        version = weight_version or agreed_version(prepared)
        committed = self.fan_out(lambda e: e.commit_weights_update(version, pause_mode))
        failed = self.failures(committed)
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

    def _combined(self, results: list[Any], what: str) -> dict:
        failed = self.failures(results)
        if failed:
            return {"success": False, "message": f"failed on {failed}"}
        return {"success": True, "message": f"{what} on {len(self.urls)} servers"}

    def _named(self, results: list[Any]) -> dict[str, Any]:
        return {url: (f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else r)
                for url, r in zip(self.urls, results, strict=True)}

    def app(self) -> Any:
        """The HTTP front (FastAPI), checking and presenting this router's keys."""
        from hotswap.engine.server.router_app import create_router_app

        return create_router_app(self)


def agreed_version(replies: list[Any]) -> str:
    """One version for servers that each proposed their next one: the highest (numbers compare
    as numbers), as WeightSender agrees for several targets."""
    proposed = [str(r.get("weight_version")) for r in replies]
    return max(proposed, key=lambda v: (v.isdigit(), int(v) if v.isdigit() else 0, v))


def affinity_key(path: str, body: dict[str, Any]) -> Key:
    """The first prompt of a request, as the tree compares it: text, token ids, or messages as
    canonical JSON (equal conversation prefixes give equal JSON prefixes)."""
    if path == "/v1/chat/completions" or body.get("messages") is not None:
        messages = body.get("messages") or []
        if messages and isinstance(messages[0], list):
            messages = messages[0]
        return _canonical(messages)[:-1]  # without "]", so a longer conversation extends it
    prompt = body.get("input_ids")
    if prompt is None:
        prompt = body.get("prompt", body.get("text"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)
    return ""


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def main(argv: list[str] | None = None) -> None:
    from hotswap.engine.server.router_app import main as serve

    serve(argv)


if __name__ == "__main__":
    main()


def _one_version_only(commit: bool | None) -> None:
    if commit is False:
        raise ValueError("commit=False: staged updates are per server; the router commits every "
                         "update on all servers or none")
