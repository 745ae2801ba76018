"""Weight sync: a trainer process pushes SmolLM2-135M (fp32, ~540 MB) into an engine process.

python bench/weight_sync.py [--repeats 3] [--bucket-mb 32] [--stall-requests 4]

This process runs the engine (reached through the small RPC in tests/rpc_proxy.py); a spawned
trainer process (tests/torchrun_sender.py) holds perturbed weights and sends them with
WeightSender over gloo on localhost. Measured in one run, between the same two processes:
- end-to-end update time: WeightSender.send called -> every target committed the new version,
  for load_format None (one broadcast per tensor) and "flattened_bucket";
- a raw gloo broadcast of the same bytes in the same messages (one per tensor, or one per
  bucket), timed on the receiving side; the ratio e2e / raw is the price of the update protocol
  (RPC, validation, pause, copy into the model, version bump);
- the stall in-flight streaming requests see in each pause mode: the time between a request's
  last token under the old weights and its first under the new ones (this includes the first
  forward's rebuild of the packed weight copies, printed at the end). Under "abort" the client
  resubmits prompt + tokens so far at once, as an RL rollout worker would.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
from safetensors import safe_open

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model
from hotswap.weight_sync import init_process_group, plan_buckets

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from rpc_proxy import RpcServer  # noqa: E402
from torchrun_sender import TrainerProcess, free_port  # noqa: E402

FORMATS = (None, "flattened_bucket")
PAUSE_MODES = ("retract", "in_place", "abort")


def tensor_specs(model_path: str) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) in the order the trainer sends (sorted names), as fp32."""
    with safe_open(os.path.join(model_path, "model.safetensors"), framework="pt") as f:
        return [(n, torch.float32, tuple(f.get_slice(n).get_shape())) for n in sorted(f.keys())]


def raw_broadcast(trainer: TrainerProcess, sizes: list[int], repeats: int) -> list[float]:
    """Seconds per round of plain gloo broadcasts of `sizes` bytes, timed on this (receiving)
    side from the moment both sides are ready to the last byte landing."""
    port = free_port()
    trainer.start("raw", master_port=port, group_name="raw", sizes=sizes, repeats=repeats)
    group = init_process_group("127.0.0.1", port, 1, 2, "raw", "gloo", timeout_s=120)
    buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    group.broadcast(torch.zeros(1))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for buf in buffers:
            group.broadcast(buf)
        times.append(time.perf_counter() - start)
    trainer.result(120)
    group.destroy()
    return times


def measure_updates(engine: Engine, trainer: TrainerProcess, load_format: str | None,
                    repeats: int) -> tuple[list[float], list[float]]:
    """(end-to-end seconds at the trainer, seconds inside the engine's commit) per update."""
    e2e, commit = [], []
    for _ in range(repeats):
        out = trainer.call("send", wait_s=300, key="w", load_format=load_format)
        assert out["replies"][0]["success"], out
        e2e.append(out["seconds"])
        commit.append(engine.weights.last_update_s)
    return e2e, commit


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


def measure_stall(engine: Engine, trainer: TrainerProcess, mode: str, requests: int
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
    out = trainer.call("send", wait_s=300, key="w", load_format="flattened_bucket",
                       pause_mode=mode)
    for f in followers:
        f.join(120)
    return [f.stall() for f in followers], out["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--stall-requests", type=int, default=4)
    args = parser.parse_args()
    path = ensure_model(args.model_path)
    bucket_bytes = args.bucket_mb << 20
    specs = tensor_specs(path)
    total = sum(torch.Size(s).numel() * 4 for _, _, s in specs)
    engine = Engine(path, dtype="float32", max_total_tokens=16384, weight_update_timeout_s=300)
    trainer = TrainerProcess()
    trainer.call("load", wait_s=300, key="w", model_path=path, seed=1, scale=0.02)
    print(f"model: {path}, {len(specs)} tensors, {total / 1e6:.0f} MB fp32; "
          f"bucket {args.bucket_mb} MB; torch threads {torch.get_num_threads()}; "
          f"median of {args.repeats}")

    per_tensor = [torch.Size(s).numel() * 4 for _, _, s in specs]
    per_bucket = [b.nbytes for b in plan_buckets(specs, bucket_bytes)]
    raw = {None: raw_broadcast(trainer, per_tensor, args.repeats),
           "flattened_bucket": raw_broadcast(trainer, per_bucket, args.repeats)}
    raw_one = raw_broadcast(trainer, [total], args.repeats)

    server = RpcServer(engine)
    trainer.call("connect", address=server.address, authkey=server.authkey,
                 master_port=free_port(), bucket_bytes=bucket_bytes, timeout_s=300)
    rows = []
    for load_format in FORMATS:
        e2e, commit = measure_updates(engine, trainer, load_format, args.repeats)
        rows.append((str(load_format), statistics.median(e2e), statistics.median(commit),
                     statistics.median(raw[load_format])))
    stalls = {mode: measure_stall(engine, trainer, mode, args.stall_requests)
              for mode in PAUSE_MODES}
    repack_s = engine.scheduler.runner.last_pack_s
    trainer.call("close")
    server.close()
    trainer.close()
    engine.shutdown()

    print(f"\nraw gloo broadcast, one {total / 1e6:.0f} MB buffer: "
          f"{statistics.median(raw_one):.3f} s ({total / statistics.median(raw_one) / 1e9:.2f} "
          f"GB/s); per tensor ({len(per_tensor)} messages) / per bucket ({len(per_bucket)})"
          " below")
    print(f"\n{'load_format':<18}{'e2e s':>8}{'GB/s':>7}{'commit s':>10}{'raw s':>8}"
          f"{'raw GB/s':>9}{'e2e/raw':>9}")
    for name, e2e, commit, raw_s in rows:
        print(f"{name:<18}{e2e:>8.3f}{total / e2e / 1e9:>7.2f}{commit:>10.3f}{raw_s:>8.3f}"
              f"{total / raw_s / 1e9:>9.2f}{e2e / raw_s:>9.2f}")
    print(f"\nstall of {args.stall_requests} streaming requests per pause mode "
          "(flattened_bucket; last old-version token -> first new-version token)")
    print(f"{'pause_mode':<12}{'update s':>10}{'stall median':>14}{'stall max':>11}"
          f"{'stall/update':>14}")
    for mode, (values, update_s) in stalls.items():
        med = statistics.median(values)
        print(f"{mode:<12}{update_s:>10.3f}{med:>14.3f}{max(values):>11.3f}"
              f"{med / update_s:>14.2f}")
    print(f"\nthe first forward after an update rebuilds the packed weight copies (CPU fp32): "
          f"{repack_s:.3f} s, inside the stalls above, not in e2e")


if __name__ == "__main__":
    main()
