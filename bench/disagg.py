"""Prefill/decode disaggregation: long prompts arriving while decodes run, on this machine's cores.

python bench/disagg.py [--duration 60] [--decodes 32] [--long-every 2.0]
                       [--long-tokens 1000,2000] [--decode-new 128] [--long-new 16]
                       [--dtype auto] [--setups one,colocated,pd] [--repeats 1]

Three setups of server processes (`python -m hotswap.engine.server`), each run for --duration
seconds under the same load, one after the other in every repeat:
- one:       one engine on every core;
- colocated: two engines (role "both") on half the cores each, requests split between them;
- pd:        a prefill engine and a decode engine on half the cores each, behind a PDRouter in
             this process (KV over shared memory).
The load: --decodes clients each streaming chat completions of --decode-new tokens back to
back (so that many decodes always run), and a long prompt (a random document of 1-2k tokens
and a question; no two share a prefix) arriving every --long-every seconds (seeded jitter),
answered in --long-new tokens. Printed per setup: decode inter-token latency p50/p99 (the gaps
between stream events of the decode clients), time to first token p50/p99 of the long prompts,
generated tokens per second (all requests) and prompt tokens per second; then the ratios of pd
to colocated and one, measured in the same run, and for pd where a handoff's time goes (bytes,
export on the prefill engine, checksum and shm write, read and check, import into the decode
engine's pages) against the request's time to first token.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict

import httpx
from throughput import chat_prompts  # bench/ is on sys.path as a script
from transformers import AutoTokenizer

from hotswap.engine import RemoteEngine
from hotswap.engine.models.fetch import ensure_model
from hotswap.fleet import PDRouter
from hotswap.weight_sync.group import free_port

WORDS = ["river", "stone", "market", "engine", "garden", "signal", "harbor", "lantern",
         "orbit", "meadow", "copper", "ledger", "thunder", "violet", "canyon", "ember", "quartz",
         "tundra", "beacon", "prism", "falcon", "willow", "summit", "delta", "mosaic", "glacier",
         "cipher", "anchor", "velvet", "nebula"]


def serve(path: str, dtype: str, role: str, cores: list[int]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores)), "HOTSWAP_API_KEY": "",
           "HOTSWAP_ADMIN_KEY": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hotswap.engine.server", "--model-path", path, "--port",
         str(port), "--dtype", dtype, "--role", role, "--max-total-tokens", "65536",
         "--log-level", "warning"],
        env=env, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server ({role}) exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not start")


def long_prompt(tokenizer, rng: random.Random, tokens: int) -> list[int]:
    """A document of random words (no two requests share a prefix) and a question."""
    words = " ".join(rng.choice(WORDS) for _ in range(int(tokens * 0.9)))
    msgs = [{"role": "user", "content": f"Document: {words}\n\nWhich word appears most often "
                                        "in the document? Answer in one sentence."}]
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return ids[-tokens:] if len(ids) > tokens else ids


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


class Load:
    """Drives one setup: `pick(kind, i)` gives the client (engine or router) for a request."""

    def __init__(self, args: argparse.Namespace, tokenizer, pick) -> None:
        self.args, self.tokenizer, self.pick = args, tokenizer, pick
        self.itl: list[float] = []  # decode clients' gaps between events
        self.ttft: list[float] = []  # long prompts
        self.tokens: list[float] = []  # the time of every generated token
        self.prompt_tokens = 0
        self.handoffs: list[tuple[dict, float, int]] = []  # (kv_handoff, ttft, prompt len)
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def stream(self, client, ids: list[int], new: int, kind: str, stop: float) -> None:
        params = {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}
        start = last = time.perf_counter()
        first = None
        gaps, stamps, handoff = [], [], None
        try:
            for event in client.generate(input_ids=ids, sampling_params=params, stream=True):
                now = time.perf_counter()
                if event["output_ids"]:
                    if first is None:
                        first = now - start
                    else:
                        gaps.append(now - last)
                    stamps.extend([now] * len(event["output_ids"]))
                    last = now
                handoff = event["meta_info"].get("kv_handoff") or handoff
                if now > stop:
                    break
        except Exception as exc:  # noqa: BLE001 - counted and printed, the run goes on
            with self.lock:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        with self.lock:
            self.tokens.extend(stamps)
            self.prompt_tokens += len(ids)
            if kind == "decode":
                self.itl.extend(gaps)
            elif first is not None:
                self.ttft.append(first)
                if handoff is not None:
                    self.handoffs.append((handoff, first, len(ids)))

    def run(self, seed: int) -> dict[str, float]:
        args, rng = self.args, random.Random(seed)
        shorts = chat_prompts(self.tokenizer, 256)
        start = time.perf_counter()
        stop = start + args.duration
        threads = []

        def decode_client(i: int) -> None:
            k = i
            while time.perf_counter() < stop:
                self.stream(self.pick("decode", i), shorts[k % len(shorts)], args.decode_new,
                            "decode", stop)
                k += args.decodes

        for i in range(args.decodes):
            threads.append(threading.Thread(target=decode_client, args=(i,), daemon=True))
            threads[-1].start()
        lo, hi = args.long_tokens
        n = 0
        next_at = start + 2.0  # the decodes reach their steady batch first
        while True:
            time.sleep(max(0.0, next_at - time.perf_counter()))
            if time.perf_counter() >= stop - 2.0:
                break
            ids = long_prompt(self.tokenizer, rng, rng.randint(lo, hi))
            t = threading.Thread(target=self.stream, daemon=True, args=(
                self.pick("long", n), ids, args.long_new, "long", stop + 30))
            t.start()
            threads.append(t)
            n += 1
            next_at += args.long_every * rng.uniform(0.5, 1.5)
        for t in threads:
            t.join(timeout=120)
        window = [s for s in self.tokens if s <= stop]
        return {"itl_p50": pct(self.itl, 50) * 1e3, "itl_p99": pct(self.itl, 99) * 1e3,
                "ttft_p50": pct(self.ttft, 50), "ttft_p99": pct(self.ttft, 99),
                "tok_s": len(window) / args.duration,
                "prompt_tok_s": self.prompt_tokens / (time.perf_counter() - start),
                "long": n, "errors": len(self.errors)}


def run_setup(name: str, args: argparse.Namespace, path: str, tokenizer, seed: int
              ) -> tuple[dict[str, float], Load]:
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    procs = []
    try:
        if name == "one":
            procs.append(serve(path, args.dtype, "both", cores))
            engine = RemoteEngine(procs[0][1], timeout_s=600)
            pick = lambda kind, i: engine  # noqa: E731
        elif name == "colocated":
            procs += [serve(path, args.dtype, "both", cores[:half]),
                      serve(path, args.dtype, "both", cores[half:] or cores[:half])]
            engines = [RemoteEngine(u, timeout_s=600) for _, u in procs]
            pick = lambda kind, i: engines[i % 2]  # noqa: E731
        else:
            procs += [serve(path, args.dtype, "prefill", cores[:half]),
                      serve(path, args.dtype, "decode", cores[half:] or cores[:half])]
            router = PDRouter([RemoteEngine(procs[0][1], timeout_s=600)],
                               [RemoteEngine(procs[1][1], timeout_s=600)], transport="shm")
            pick = lambda kind, i: router  # noqa: E731
        warm = pick("decode", 0)
        warm.generate(input_ids=long_prompt(tokenizer, random.Random(0), 1500),
                      sampling_params={"max_new_tokens": 4})
        load = Load(args, tokenizer, pick)
        return load.run(seed), load
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def transfer_report(loads: list[Load]) -> None:
    rows = [h for load in loads for h in load.handoffs]
    if not rows:
        return
    mb = statistics.median(h["bytes"] for h, _, _ in rows) / 1e6
    tokens = statistics.median(n for _, _, n in rows)
    parts = {"export (prefill engine: KV out of its pool)": "export_s",
             "checksum + shm write (prefill engine)": "publish_s",
             "shm read + checksum (decode engine)": "receive_s",
             "import into pages + radix cache (decode engine)": "import_s"}
    ttft = statistics.median(t for _, t, _ in rows)
    accepted = sum(h["accepted"] for h, _, _ in rows)
    print(f"\nWhere a pd handoff's time goes ({len(rows)} long prompts, {accepted} accepted; "
          f"median {tokens:.0f} tokens, {mb:.1f} MB of KV; median TTFT {ttft:.2f} s):")
    print("| step | median ms | share of TTFT |")
    print("| --- | ---: | ---: |")
    total = 0.0
    for name, key in parts.items():
        med = statistics.median(h[key] for h, _, _ in rows)
        total += med
        print(f"| {name} | {med * 1e3:.1f} | {med / ttft:.1%} |")
    print(f"| all of the handoff | {total * 1e3:.1f} | {total / ttft:.1%} |")
    print(f"(for scale: {mb:.1f} MB copied once at 5 GB/s takes {mb / 5:.1f} ms)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--decodes", type=int, default=32)
    p.add_argument("--long-every", type=float, default=2.0)
    p.add_argument("--long-tokens", default="1000,2000")
    p.add_argument("--decode-new", type=int, default=128)
    p.add_argument("--long-new", type=int, default=16)
    p.add_argument("--setups", default="one,colocated,pd")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    args.long_tokens = tuple(int(x) for x in args.long_tokens.split(","))
    path = ensure_model(args.model_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    setups = args.setups.split(",")
    cores = len(os.sched_getaffinity(0))
    print(f"{os.path.basename(path)} dtype={args.dtype}, {cores} cores; {args.decodes} decode "
          f"streams x {args.decode_new} tokens, a {args.long_tokens[0]}-{args.long_tokens[1]}"
          f"-token prompt every ~{args.long_every:g} s x {args.long_new} tokens; "
          f"{args.duration:g} s per setup, {args.repeats} repeat(s)")
    results: dict[str, list[dict[str, float]]] = defaultdict(list)
    loads: dict[str, list[Load]] = defaultdict(list)
    for repeat in range(args.repeats):
        for name in setups:
            row, load = run_setup(name, args, path, tokenizer, seed=repeat)
            results[name].append(row)
            loads[name].append(load)
            print(f"  repeat {repeat} {name}: " + ", ".join(
                f"{k} {v:.3g}" for k, v in row.items()), flush=True)
            for error in load.errors[:3]:
                print(f"    error: {error}")
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
           for name, rows in results.items()}
    print("\n| setup | decode ITL p50 ms | ITL p99 ms | long TTFT p50 s | TTFT p99 s "
          "| generated tok/s | prompt tok/s | long prompts |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, row in med.items():
        print(f"| {name} | {row['itl_p50']:.0f} | {row['itl_p99']:.0f} | {row['ttft_p50']:.2f} "
              f"| {row['ttft_p99']:.2f} | {row['tok_s']:.0f} | {row['prompt_tok_s']:.0f} "
              f"| {row['long']:.0f} |")
    if "pd" in med:
        for base in ("colocated", "one"):
            if base in med:
                pd, b = med["pd"], med[base]
                print(f"pd / {base}: ITL p99 {pd['itl_p99'] / b['itl_p99']:.2f}x, ITL p50 "
                      f"{pd['itl_p50'] / b['itl_p50']:.2f}x, TTFT p50 "
                      f"{pd['ttft_p50'] / b['ttft_p50']:.2f}x, generated tok/s "
                      f"{pd['tok_s'] / b['tok_s']:.2f}x")
        transfer_report(loads["pd"])


if __name__ == "__main__":
    main()
