"""Colocation: an engine sharing its process with a trainer, against the same engine alone.

python bench/colocation.py [--dtype float32] [--repeats 3] [--trainer matmuls|hf]
Three processes run the same rollout (8 prompts x n=8 x 48 new tokens, temperature 1, eos
ignored), one after the other in every repeat so that a slow period of the machine hits all:
  clean       an engine alone in its process;
  colocated   before every rollout the process's main thread runs trainer work (200 small
              matmuls, or with --trainer hf a forward+backward of the HF model on 2 x 64 tokens),
              then calls generate (the alternating pattern of an in-process RL loop);
  unreleased  the same, with the engine's OpenMP team release switched off (the old behaviour).
Prints median tokens/s, the colocated/clean ratio, and the time of an in-process
update_weights_from_tensor of every weight (from the HF trainer model) in the colocated process.

First, the mechanism, measured in this process and independent of machine load: voluntary
context switches per small parallel op (a [64, 576] multiply) run by an engine-like thread,
alone, after the main thread has run a parallel op (a second OpenMP team), and after the main
thread released its team (engine/executor/omp.py). About 2 switches per op mean the worker
sleeps on a futex between ops (libgomp's throttled spin); about 0 mean it spins.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time

import torch
import transformers
from throughput import chat_prompts  # bench/ is on sys.path when run as a script

from hotswap.engine import Engine
from hotswap.engine.executor.omp import release_thread_team
from hotswap.engine.models.fetch import ensure_model

_STATE: dict = {}


def _start(path: str, dtype: str, trainer: str | None, release: bool) -> None:
    if not release:  # the behaviour before executor/omp.py: teams are never released
        import hotswap.engine.scheduler.scheduler as sched_mod

        sched_mod.release_thread_team = lambda: False
    engine = Engine(path, dtype=dtype)
    _STATE.update(engine=engine, trainer=trainer,
                  prompts=chat_prompts(engine.tokenizer, 8))
    if trainer == "hf":
        _STATE["model"] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32)


def _trainer_step() -> None:
    """Work a trainer does in the caller's thread between two rollouts."""
    if _STATE["trainer"] == "hf":
        model = _STATE["model"]
        ids = torch.randint(0, model.config.vocab_size, (2, 64))
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        return
    a, b = torch.randn(64, 576), torch.randn(576, 576) * 0.04
    for _ in range(200):
        a = torch.tanh(a @ b)


def rollout(new: int) -> float:
    if _STATE["trainer"] is not None:
        _trainer_step()
    engine = _STATE["engine"]
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(input_ids=_STATE["prompts"], sampling_params={
        "max_new_tokens": new, "n": 8, "temperature": 1.0, "ignore_eos": True})
    return sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - start)


def update_seconds(path: str, repeats: int = 3) -> float:
    """Median seconds of an in-process update_weights_from_tensor of all weights."""
    if "model" not in _STATE:
        _STATE["model"] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32)
    engine, params = _STATE["engine"], dict(_STATE["model"].named_parameters())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.update_weights_from_tensor(params)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _voluntary_switches() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f
                             if line.startswith("voluntary_ctxt_switches"))
        except FileNotFoundError:  # a thread that just ended
            pass
    return total


def _small_ops(n: int = 2000) -> tuple[float, float]:
    """(us per op, voluntary context switches per op) of n small parallel multiplies."""
    a, b = torch.randn(64, 576), torch.randn(64, 576)
    switches, start = _voluntary_switches(), time.perf_counter()
    for _ in range(n):
        torch.mul(a, b, out=a)
    return (time.perf_counter() - start) / n * 1e6, (_voluntary_switches() - switches) / n


def mechanism() -> None:
    """The engine-like thread keeps its team between measurements, as the scheduler does."""
    todo: queue.Queue[None] = queue.Queue()
    done: queue.Queue[tuple[float, float]] = queue.Queue()

    def engine_thread() -> None:
        while True:
            todo.get()
            done.put(_small_ops())

    threading.Thread(target=engine_thread, daemon=True).start()

    def measure(label: str) -> None:
        todo.put(None)
        us, switches = done.get()
        print(f"  {label:<46}{switches:>6.2f} switches/op {us:>9.1f} us/op", flush=True)

    print("mechanism: a thread's small parallel ops (us/op depends on machine load):")
    measure("alone")
    a = torch.randn(256, 256)
    (a @ a).sum()  # the main thread now masters a second team
    measure("after the main thread ran a parallel op")
    release_thread_team()
    measure("after the main thread released its team")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--trainer", choices=["matmuls", "hf"], default="matmuls")
    args = parser.parse_args()
    path = ensure_model(args.model_path)
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:  # a clean process for the mechanism check
        pool.apply(mechanism)
    sides = {"clean": (None, True), "colocated": (args.trainer, True),
             "unreleased": (args.trainer, False)}
    pools = {name: ctx.Pool(1, initializer=_start, initargs=(path, args.dtype, t, rel))
             for name, (t, rel) in sides.items()}
    for pool in pools.values():  # warm-up: first-call paths and packed weights
        pool.apply(rollout, (4,))
    results: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, pool in pools.items():
            results[name].append(pool.apply(rollout, (args.new,)))
    med = {name: statistics.median(v) for name, v in results.items()}
    print(f"dtype {args.dtype}, trainer {args.trainer}, {args.repeats} repeats, tok/s "
          "(median; all runs):")
    for name, v in results.items():
        runs = ", ".join(f"{x:.0f}" for x in v)
        print(f"  {name:<11}{med[name]:>8.1f}  x{med[name] / med['clean']:.2f} of clean  "
              f"[{runs}]")
    upd = pools["colocated"].apply(update_seconds, (path,))
    print(f"in-process update_weights_from_tensor (all weights, colocated process): {upd:.3f} s")
    for pool in pools.values():
        pool.close()


if __name__ == "__main__":
    main()
