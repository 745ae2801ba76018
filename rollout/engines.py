"""The GRPO job's engines: the policy's (in-process, a server process over gloo, or a Ray fleet),
each with the push that brings the trainer's weights into it, and the scoring engines (a judge, a
reward model) that no push reaches.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from hotswap.weight_sync.group import free_port


@dataclass
class EngineHandle:
    backend: Any  # Engine, RemoteEngine or RayFleet
    # Pushes the named tensors as that version; returns what went: {"kind", "bytes", ...}.
    push: Callable[[list[tuple[str, torch.Tensor]], str], dict[str, Any]]
    close: Callable[[], None]


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine keyword arguments the job's flags choose beyond dtype, seed and pool size."""
    options: dict[str, Any] = {}
    if args.quantization:
        options["quantization"] = args.quantization
    if args.routing_replay:
        options["enable_return_routed_experts"] = True
    if args.speculative:
        options["speculative"] = args.speculative
    if args.exact_logprobs:
        options["deterministic"] = True
    return options


def start_in_process(path: str, dtype: str, seed: int, kv_tokens: int,
                     options: dict[str, Any], delta: bool = False) -> EngineHandle:
    from hotswap.engine import Engine
    from hotswap.weight_sync import DeltaTracker, update_in_process

    engine = Engine(path, dtype=dtype, seed=seed, max_total_tokens=kv_tokens, **options)
    tracker = DeltaTracker(engine.runner.dtype) if delta else None

    def push(named: list[tuple[str, torch.Tensor]], version: str) -> dict[str, Any]:
        if tracker is not None:
            reply, pushed = update_in_process(engine, named, tracker, weight_version=version)
        else:
            reply = engine.update_weights_from_tensor(named, weight_version=version)
            pushed = _full_push(named)
        if not reply["success"]:
            raise RuntimeError(f"weight update failed: {reply['message']}")
        return pushed

    return EngineHandle(engine, push, engine.shutdown)


def _full_push(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    return {"kind": "full", "bytes": sum(t.nbytes for _, t in named)}


def start_server_process(path: str, dtype: str, seed: int, kv_tokens: int,
                         options: dict[str, Any], delta: bool = False) -> EngineHandle:
    """The engine as `python -m hotswap.engine.server` in a child process; weights over gloo."""
    from hotswap.engine import RemoteEngine
    from hotswap.weight_sync import WeightSender

    port, admin = free_port(), secrets.token_hex(8)
    flags = []  # the server's flags carry the Engine's argument names
    for key, value in options.items():
        flags += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    proc = subprocess.Popen([sys.executable, "-m", "hotswap.engine.server", "--model-path", path,
                             "--port", str(port), "--admin-key", admin, "--dtype", dtype,
                             "--seed", str(seed), "--max-total-tokens", str(kv_tokens),
                             "--log-level", "warning", *flags])
    remote = RemoteEngine(f"http://127.0.0.1:{port}", admin_key=admin)
    _wait_healthy(remote, proc)
    sender = WeightSender("127.0.0.1", free_port(), world_size=2, backend="gloo",
                          bucket_bytes=32 << 20)

    def push(named: list[tuple[str, torch.Tensor]], version: str) -> dict[str, Any]:
        sender.send(named, [remote], weight_version=version, delta=delta)
        return sender.last_push

    def close() -> None:
        try:
            sender.close([remote])
        finally:
            remote.shutdown()
            proc.terminate()
            proc.wait(30)

    return EngineHandle(remote, push, close)


def _wait_healthy(remote: Any, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the engine server exited with code {proc.returncode}")
        try:
            remote.health()
            return
        except Exception:  # not listening yet
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the engine server did not become healthy in time")


def start_ray_fleet(path: str, dtype: str, seed: int, kv_tokens: int, replicas: int,
                    transport: str, options: dict[str, Any], delta: bool = False
                    ) -> EngineHandle:
    """`replicas` engines as Ray actors (a local Ray unless one is running), one CPU each."""
    from hotswap.fleet import RayFleet
    from hotswap.weight_sync import DeltaTracker, WeightSender, str_to_dtype, update_in_process

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray: 127.0.0.1
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    fleet = RayFleet(path, replicas=replicas, engine_kwargs={
        "dtype": dtype, "seed": seed, "max_total_tokens": kv_tokens, **options})
    sender = (WeightSender("127.0.0.1", free_port(), world_size=1 + fleet.weight_sync_ranks,
                           backend="gloo", bucket_bytes=32 << 20)
              if transport == "gloo" else None)

    tracker = DeltaTracker(str_to_dtype(fleet.weights_dtype)) if delta else None

    def push(named: list[tuple[str, torch.Tensor]], version: str) -> dict[str, Any]:
        if sender is not None:
            sender.send(named, [fleet], weight_version=version, delta=delta)
            return sender.last_push
        if tracker is not None:
            reply, pushed = update_in_process(fleet, named, tracker, weight_version=version)
        else:
            reply = fleet.update_weights_from_tensor(named, weight_version=version)
            pushed = _full_push(named)
        if not reply["success"]:
            raise RuntimeError(f"weight update failed: {reply['message']}")
        return pushed

    def close() -> None:
        try:
            if sender is not None:
                sender.close([fleet])
        finally:
            fleet.shutdown()

    return EngineHandle(fleet, push, close)


def replica_metrics(fleet: Any, before: dict[int, dict], seconds: float
                    ) -> tuple[dict[str, Any], dict[int, dict]]:
    """Per replica since `before`: requests, tokens per second of the step, weight version."""
    now = {r["index"]: r for r in fleet.replicas_info()}
    metrics: dict[str, Any] = {}
    cells = []
    for index, r in sorted(now.items()):
        old = before.get(index, {"requests": 0, "tokens": 0})
        requests, tokens = r["requests"] - old["requests"], r["tokens"] - old["tokens"]
        rate = tokens / seconds if seconds > 0 else math.nan
        metrics.update({f"replica/{index}/requests": requests,
                        f"replica/{index}/tokens_per_s": rate})
        cells.append(f"{index}:{requests}r {rate:.0f}t/s v{r['weight_version']} {r['state'][0]}")
    metrics["fleet/replicas"] = " | ".join(cells)
    return metrics, now


@contextmanager
def engine_for(args: argparse.Namespace, path: str) -> Iterator[EngineHandle]:
    if args.fleet == "ray":
        handle = start_ray_fleet(path, args.dtype, args.seed, args.max_total_tokens,
                                 args.replicas, args.transport, engine_options(args),
                                 args.delta_updates)
    else:
        start = start_server_process if args.transport == "gloo" else start_in_process
        handle = start(path, args.dtype, args.seed, args.max_total_tokens, engine_options(args),
                       args.delta_updates)
    try:
        yield handle
    finally:
        handle.close()


def start_scorer(path: str, args: argparse.Namespace) -> Any:
    """A judge's or reward model's engine, in this process: its own weights, frozen (an update
    that does not name it is refused), so no push of the job reaches it (the policy's checkpoint
    too gets an engine of its own). Every scoring engine of the job is made here."""
    from hotswap.engine import Engine

    return Engine(path, dtype=args.dtype, seed=args.seed, max_total_tokens=args.max_total_tokens,
                  frozen=True)
