"""Weight sync: a trainer process pushes SmolLM2-135M (fp32, ~540 MB) into an engine process.

python bench/weight_sync.py [--repeats 5] [--bucket-mb 32] [--stall-requests 4]
                            [--staging standby none] [--dtypes float32 bfloat16]
                            [--quantization int8]
python bench/weight_sync.py --delta [--dtypes bfloat16 float32] [--lrs 1e-6 1e-5]
                            (delta vs full pushes: bench/delta_sync.py)

This process runs one engine per `--dtypes` entry (each reached through
hotswap.weight_sync.rpc); a spawned trainer process holds perturbed fp32 weights and sends them
over gloo on localhost, one WeightSender per route. Routes ("wire>engine"): fp32>float32;
into a bfloat16 engine (an RL trainer's fp32 tensors into a bf16 rollout engine: the common
case) fp32>bfloat16, where the sender is not told the engine's dtype and the engine converts
as the tensors land, and bf16>bfloat16, where the target reports its `weights_dtype` (as an
Engine or RemoteEngine does) and the sender rounds before the wire.
Measured in one run, between the same two processes:
- end-to-end update time: WeightSender.send called -> every target committed the new version,
  per route, for load_format None (one broadcast per tensor) and "flattened_bucket", and per
  staging mode (the `staging` argument of each update: "standby", the default, and "none", in
  place);
- a raw gloo broadcast of the same (fp32) bytes in the same messages (one per tensor, or one
  per bucket), timed on the receiving side; the ratio e2e / raw is the price of the update
  protocol (and of the conversion into a bfloat16 engine; below 1 when bf16 is on the wire);
- where the engine's share goes, per stage (the engine's own timings of each update), and what
  is left for the RPC and the sender: e2e minus the engine's stages;
- the memory an update costs on the engine side (this process): peak RSS during the update
  minus RSS before it; the first "standby" update of a run allocates the standby buffer (kept),
  later ones reuse it;
- the stall in-flight streaming requests see in each pause mode: the time between a request's
  last token under the old weights and its first under the new ones (this includes the first
  forward's rebuild of the packed weight copies, printed at the end). Under "abort" the client
  resubmits prompt + tokens so far at once, as an RL rollout worker would.
With --quantization int8 the engine re-quantizes the new weights inside every update (stage
"quantize" below), then rebuilds the other derived copies there too (stage "derive": the float32
head and packed copies, which a float engine rebuilds at its first forward instead); printed at
the end: the quantize stage's share of the update's e2e time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from typing import Any

import torch
from safetensors.torch import load_file

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model
from hotswap.weight_sync import WeightSender, init_process_group, plan_buckets
from hotswap.weight_sync.group import free_port
from hotswap.weight_sync.rpc import EngineProxy, RpcClient, RpcServer
from hotswap.weight_sync.sender import hf_module_order

FORMATS = (None, "flattened_bucket")
PAUSE_MODES = ("retract", "in_place", "abort")
TRAINER_METHODS = ("load", "connect", "send", "raw_open", "raw_round", "raw_close", "close")


class BenchTrainer:
    """The trainer process: perturbed weights and one WeightSender (each method an RPC)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.senders: dict[str, tuple[WeightSender, EngineProxy]] = {}  # per engine dtype
        self.raw_group: Any = None

    def load(self, model_path: str, seed: int, scale: float) -> list[tuple[str, list[int]]]:
        """The checkpoint plus noise, in HF module order; returns (name, shape) in that order."""
        tensors = load_file(os.path.join(model_path, "model.safetensors"))
        gen = torch.Generator().manual_seed(seed)
        for name in hf_module_order(model_path, list(tensors)):
            base = tensors[name].float()
            noise = torch.randn(base.shape, generator=gen)
            self.tensors[name] = base + scale * base.abs().mean() * noise
        return [(n, list(t.shape)) for n, t in self.tensors.items()]

    def connect(self, route: str, address: tuple[str, int], authkey: bytes, master_port: int,
                bucket_bytes: int, timeout_s: float, weights_dtype: str | None) -> None:
        """A sender for `route`; weights_dtype: what the target reports (None: nothing)."""
        proxy = EngineProxy(address, authkey, timeout_s=2 * timeout_s)
        if weights_dtype is not None:
            proxy.weights_dtype = weights_dtype  # type: ignore[attr-defined]
        sender = WeightSender("127.0.0.1", master_port, 2, group_name=f"bench-{route}",
                              backend="gloo", bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        sender.connect([proxy])
        self.senders[route] = sender, proxy

    def send(self, route: str, **kwargs: Any) -> dict:
        torch.set_num_threads(1)  # as the trainer's main thread (this is an RPC thread)
        sender, proxy = self.senders[route]
        start = time.perf_counter()
        replies = sender.send(self.tensors, [proxy], **kwargs)
        return {"replies": replies, "seconds": time.perf_counter() - start}

    def raw_open(self, master_port: int) -> None:
        self.raw_group = init_process_group("127.0.0.1", master_port, 0, 2, "raw", "gloo",
                                            timeout_s=120)

    def raw_round(self, sizes: list[int]) -> None:
        """Rank 0 of plain broadcasts of buffers of `sizes` bytes (allocated beforehand)."""
        torch.set_num_threads(1)
        buffers = [torch.ones(n, dtype=torch.uint8) for n in sizes]
        self.raw_group.broadcast(torch.zeros(1))  # both sides ready before the clock starts
        for buf in buffers:
            self.raw_group.broadcast(buf)

    def raw_close(self) -> None:
        self.raw_group.destroy()

    def close(self) -> None:
        for sender, proxy in self.senders.values():
            sender.close([proxy])
        self.senders.clear()


def _trainer_main(conn: Any) -> None:
    torch.set_num_threads(1)
    with RpcServer(BenchTrainer(), exposed=TRAINER_METHODS) as server:
        conn.send((server.address, server.authkey))
        conn.recv()  # until the bench says stop (or dies: EOFError)


def spawn_trainer() -> tuple[mp.Process, Any, RpcClient]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_trainer_main, args=(child,), daemon=True)
    proc.start()
    address, authkey = conn.recv()
    return proc, conn, RpcClient(address, authkey, timeout_s=600)


class RawGroup:
    """Plain gloo broadcasts between the same two processes, beside the update's group."""

    def __init__(self, trainer: RpcClient) -> None:
        self.trainer = trainer
        port = free_port()
        call = threading.Thread(target=trainer.call, args=("raw_open",),
                                kwargs=dict(master_port=port))
        call.start()
        self.group = init_process_group("127.0.0.1", port, 1, 2, "raw", "gloo", timeout_s=120)
        call.join(120)
        self.buffers: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def round(self, sizes: list[int]) -> float:
        """Seconds for one round of `sizes` bytes, timed on this (receiving) side from the
        moment both sides are ready to the last byte landing."""
        buffers = self.buffers.setdefault(
            tuple(sizes), [torch.empty(n, dtype=torch.uint8) for n in sizes])
        call = threading.Thread(target=self.trainer.call, args=("raw_round",),
                                kwargs=dict(sizes=sizes))
        call.start()
        self.group.broadcast(torch.zeros(1))
        start = time.perf_counter()
        for buf in buffers:
            self.group.broadcast(buf)
        seconds = time.perf_counter() - start
        call.join(120)
        return seconds

    def close(self) -> None:
        call = threading.Thread(target=self.trainer.call, args=("raw_close",))
        call.start()
        self.group.destroy()
        call.join(120)


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class Update:
    """One measured update: e2e at the trainer, the engine's stages, the RSS it cost (peak
    during it and kept after it)."""

    def __init__(self, engine: Engine, key: str, trainer: RpcClient, **kwargs: Any) -> None:
        before = _status_mb("VmRSS")
        peak_ok = _reset_peak_rss()
        out = trainer.call("send", route=key, **kwargs)
        assert out["replies"][0]["success"], out
        self.e2e = out["seconds"]
        self.stages = dict(getattr(engine.weights, "last_stages", {}))  # absent before 31
        self.rss_mb = _status_mb("VmHWM") - before if peak_ok else float("nan")
        self.kept_mb = _status_mb("VmRSS") - before


Row = tuple[str, str, str | None]  # (route, staging, load_format)
WIRE = {"float32": "fp32", "bfloat16": "bf16"}


def routes_of(dtypes: list[str]) -> dict[str, tuple[str, str | None]]:
    """route -> (engine dtype, the weights_dtype its target reports): fp32 on the wire into
    every engine, and bf16 too into a bfloat16 engine (the sender rounds)."""
    out: dict[str, tuple[str, str | None]] = {}
    for dtype in dtypes:
        out[f"fp32>{dtype}"] = dtype, None
        if dtype != "float32":
            out[f"{WIRE[dtype]}>{dtype}"] = dtype, dtype
    return out


def measure(engines: dict[str, Engine], trainer: RpcClient, raw: RawGroup, sizes: dict,
            repeats: int, stagings: list[str]) -> dict[Row, tuple[list[Update], list[float]]]:
    """Per (route, staging, format) (`engines` by route), `repeats` updates and as many raw
    rounds, alternating: raw, update, ...; the rows swap order every repeat."""
    rows = [(r, s, f) for r in engines for s in stagings for f in FORMATS]
    out: dict[Row, tuple[list[Update], list[float]]] = {r: ([], []) for r in rows}
    for i in range(repeats):
        for route, staging, f in rows if i % 2 == 0 else rows[::-1]:
            out[route, staging, f][1].append(raw.round(sizes[f]))
            out[route, staging, f][0].append(
                Update(engines[route], route, trainer, load_format=f, staging=staging))
    return out


class Follower(threading.Thread):
    """Streams one request and records (time, version) per token; after an abort it resubmits
    prompt + tokens so far. Stops after `after` tokens under a version other than `old`."""

    def __init__(self, engine: Engine, prompt: list[int], old: str, rid: str,
                 after: int = 3) -> None:
        super().__init__(daemon=True)
        self.engine, self.prompt, self.old, self.rid, self.after = engine, prompt, old, rid, after
        self.tokens: list[tuple[float, str]] = []
        self.started = threading.Event()

    def run(self) -> None:
        ids: list[int] = []
        attempt = 0
        while self.new_tokens() < self.after:
            rid = f"{self.rid}-{attempt}"
            attempt += 1
            stream = self.engine.generate(
                input_ids=self.prompt + ids, rid=rid, stream=True,
                sampling_params={"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True})
            for event in stream:
                now = time.perf_counter()
                version = event["meta_info"]["weight_version"]
                for token in event["output_ids"]:
                    ids.append(token)
                    self.tokens.append((now, version))
                if len(self.tokens) >= 5:
                    self.started.set()
                if self.new_tokens() >= self.after:
                    self.engine.abort_request(rid)
            # an aborted stream ends here; the loop resubmits with the tokens so far

    def new_tokens(self) -> int:
        return sum(v != self.old for _, v in self.tokens)

    def stall(self) -> float:
        last_old = max(t for t, v in self.tokens if v == self.old)
        first_new = min(t for t, v in self.tokens if v != self.old)
        return first_new - last_old


def measure_stall(engine: Engine, key: str, trainer: RpcClient, mode: str, requests: int
                  ) -> tuple[list[float], float]:
    """Per-request stalls and the update's end-to-end time, for one update in `mode`."""
    prompts = [engine.tokenizer.encode(f"Write a long story about dragon number {i}.")
               for i in range(requests)]
    old = engine.get_weight_version()
    followers = [Follower(engine, p, old, f"stall-{mode}-{i}") for i, p in enumerate(prompts)]
    for f in followers:
        f.start()
    for f in followers:
        f.started.wait(120)
    out = trainer.call("send", route=key, load_format="flattened_bucket",
                       pause_mode=mode)
    for f in followers:
        f.join(120)
    return [f.stall() for f in followers], out["seconds"]


def print_stalls(stalls: dict[tuple[str, str], tuple[list[float], float]], requests: int
                 ) -> None:
    """The stall table; none with --stall-requests 0."""
    if not stalls:
        return
    print(f"\nstall of {requests} streaming requests per pause mode "
          "(flattened_bucket, staging standby; last old-version token -> first new-version "
          "token)")
    print(f"{'route':<16}{'pause_mode':<12}{'update s':>10}{'stall median':>14}"
          f"{'stall max':>11}{'stall/update':>14}")
    for (route, mode), (values, update_s) in stalls.items():
        med = statistics.median(values)
        print(f"{route:<16}{mode:<12}{update_s:>10.3f}{med:>14.3f}{max(values):>11.3f}"
              f"{med / update_s:>14.2f}")


def print_stages(rows: list[tuple[str, list[Update], list[float]]]) -> None:
    stages: list[str] = []
    for _, updates, _ in rows:
        for u in updates:
            stages += [s for s in u.stages if s not in stages]
    print("\nwhere an update's time goes (median s per stage; 'rpc+sender' = e2e minus the "
          "engine's stages)")
    print(f"{'route, staging, format':<35}" + "".join(f"{s:>10}" for s in stages)
          + f"{'rpc+sender':>12}{'e2e':>8}{'raw':>8}")
    for name, updates, raw_s in rows:
        cells = [statistics.median(u.stages.get(s, 0.0) for u in updates) for s in stages]
        rest = statistics.median(u.e2e - sum(u.stages.values()) for u in updates)
        e2e = statistics.median(u.e2e for u in updates)
        print(f"{name:<35}" + "".join(f"{c:>10.3f}" for c in cells)
              + f"{rest:>12.3f}{e2e:>8.3f}{statistics.median(raw_s):>8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--stall-requests", type=int, default=4)
    parser.add_argument("--staging", nargs="+", default=["standby", "none"],
                        choices=("standby", "none"),
                        help="the staging modes to compare, each update's `staging` argument")
    parser.add_argument("--quantization", choices=["int8"], default=None,
                        help="an int8 engine: every update re-quantizes the weights")
    parser.add_argument("--delta", action="store_true",
                        help="delta vs full pushes after real AdamW steps (bench/delta_sync.py)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=("float32", "bfloat16"),
                        help="the engines' dtypes (one engine each; the trainer's are fp32)")
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-6, 1e-5],
                        help="with --delta: the learning rates")
    args = parser.parse_args()
    path = ensure_model(args.model_path)
    if args.delta:
        from delta_sync import run  # bench/, beside this script

        run(path, args.dtypes, args.lrs, args.repeats)
        return
    bucket_bytes = args.bucket_mb << 20
    proc, conn, trainer = spawn_trainer()
    shapes = trainer.call("load", model_path=path, seed=1, scale=0.02)
    specs = [(n, torch.float32, tuple(s)) for n, s in shapes]
    total = sum(torch.Size(s).numel() * 4 for _, _, s in specs)
    engines = {d: Engine(path, dtype=d, max_total_tokens=16384, weight_update_timeout_s=300,
                         quantization=args.quantization) for d in args.dtypes}
    print(f"model: {path}, {len(specs)} tensors, {total / 1e6:.0f} MB fp32 pushed into "
          f"{' and '.join(args.dtypes)} engines; quantization {args.quantization}; "
          f"bucket {args.bucket_mb} MB; staging {' and '.join(args.staging)}; torch threads "
          f"{torch.get_num_threads()}; median of {args.repeats}")

    sizes = {None: [torch.Size(s).numel() * 4 for _, _, s in specs],
             "flattened_bucket": [b.nbytes for b in plan_buckets(specs, bucket_bytes)]}
    raw = RawGroup(trainer)
    raw_one = [raw.round([total]) for _ in range(args.repeats)]
    servers = {d: RpcServer(e) for d, e in engines.items()}
    routes = routes_of(args.dtypes)
    for route, (dtype, reported) in routes.items():
        trainer.call("connect", route=route, address=servers[dtype].address,
                     authkey=servers[dtype].authkey, master_port=free_port(),
                     bucket_bytes=bucket_bytes, timeout_s=300, weights_dtype=reported)
    by_route = {route: engines[dtype] for route, (dtype, _) in routes.items()}
    measured = measure(by_route, trainer, raw, sizes, args.repeats, args.staging)
    rows = [(f"{r} {s}, {f}", *m) for (r, s, f), m in measured.items()]
    raw.close()
    last_route = {dtype: route for route, (dtype, _) in routes.items()}  # a real Engine's
    stalls = {(r, mode): measure_stall(engines[d], r, trainer, mode, args.stall_requests)
              for d, r in last_route.items() for mode in PAUSE_MODES if args.stall_requests > 0}
    repack_s = {d: e.scheduler.runner.last_pack_s for d, e in engines.items()}
    quant_mb = sum(e.scheduler.runner.quant_bytes for e in engines.values()) / 1e6
    trainer.call("close")
    for server in servers.values():
        server.close()
    conn.send("stop")
    proc.join(30)
    for e in engines.values():
        e.shutdown()

    print(f"\nraw gloo broadcast, one {total / 1e6:.0f} MB buffer: "
          f"{statistics.median(raw_one):.3f} s ({total / statistics.median(raw_one) / 1e9:.2f} "
          f"GB/s); per tensor ({len(sizes[None])} messages) / per bucket "
          f"({len(sizes['flattened_bucket'])}) below, each update right after a raw round")
    print("\n'peak +MB': peak RSS of the engine's process during an update minus its RSS before "
          "(first: the row's first update; later: median of the others); 'kept +MB': RSS after "
          "minus before, summed over the row's updates")
    print(f"{'route, staging, format':<35}{'e2e s':>8}{'GB/s':>7}{'raw s':>8}{'raw GB/s':>9}"
          f"{'e2e/raw':>9}{'pairs':>12}{'peak +MB first':>16}{'later':>7}{'kept +MB':>10}")
    for name, updates, raws in rows:
        e2e, raw_s = statistics.median(u.e2e for u in updates), statistics.median(raws)
        pairs = sorted(u.e2e / r for u, r in zip(updates, raws))
        later = statistics.median(u.rss_mb for u in updates[1:]) if len(updates) > 1 else 0.0
        kept = sum(u.kept_mb for u in updates)
        print(f"{name:<35}{e2e:>8.3f}{total / e2e / 1e9:>7.2f}{raw_s:>8.3f}"
              f"{total / raw_s / 1e9:>9.2f}{e2e / raw_s:>9.2f}"
              f"{f'{pairs[0]:.2f}-{pairs[-1]:.2f}':>12}{updates[0].rss_mb:>16.0f}{later:>7.0f}"
              f"{kept:>10.0f}")
    print_stages(rows)
    print_stalls(stalls, args.stall_requests)
    if args.quantization is None:
        if stalls:  # timed at the stall runs' first forward
            packs = ", ".join(f"{d} {s:.3f} s" for d, s in repack_s.items())
            print(f"\nthe first forward after an update rebuilds the packed weight copies: "
                  f"{packs}, inside the stalls above, not in e2e")
        return
    print(f"\nquantization ({args.quantization} copies: {quant_mb:.0f} MB beside the float "
          "weights), inside each update's transaction, in e2e:")
    for name, updates, _ in rows:
        shares = sorted(u.stages.get("quantize", 0.0) / u.e2e for u in updates)
        seconds = statistics.median(u.stages.get("quantize", 0.0) for u in updates)
        derive = statistics.median(u.stages.get("derive", 0.0) for u in updates)
        print(f"  {name:<35}quantize {seconds:.3f} s = {statistics.median(shares):.0%} of e2e "
              f"(range {shares[0]:.0%}-{shares[-1]:.0%}); then derive {derive:.3f} s (the "
              "float32 head and packed copies: a float engine rebuilds them at its first "
              "forward after the update, outside e2e)")


if __name__ == "__main__":
    main()
