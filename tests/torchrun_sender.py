"""The trainer side of the multi-process weight-update tests.

As a script, under `torchrun --standalone --nproc_per_node 2`: both ranks join the default gloo
group; rank 0 perturbs a checkpoint and sends it with WeightSender to an engine in another
process (reached through hotswap.weight_sync.rpc) while that group exists, and the group still
works after.
Prints one JSON line (rank 0).

Imported: `perturbed` / `save_checkpoint` make a trainer's new weights and the reference
checkpoint holding them; `TrainerProcess` is a spawned trainer that takes commands over a pipe.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hotswap.weight_sync import WeightSender, init_process_group
from hotswap.weight_sync.group import free_port
from hotswap.weight_sync.rpc import EngineProxy
from hotswap.weight_sync.sender import hf_module_order

Tensors = dict[str, torch.Tensor]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def perturbed(model_path: str, seed: int, scale: float = 0.1, dtype: str = "float32"
              ) -> Tensors:
    """The checkpoint's tensors plus noise of `scale` times each tensor's mean magnitude."""
    tensors = load_file(os.path.join(model_path, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in hf_module_order(model_path, tensors):
        base = tensors[name].float()
        noise = torch.randn(base.shape, generator=gen)
        out[name] = (base + scale * base.abs().mean() * noise).to(DTYPES[dtype])
    return out


def save_checkpoint(tensors: Tensors, src_dir: str, out_dir: str, drop: tuple[str, ...] = ()
                    ) -> str:
    """An fp32 HF folder holding `tensors` (less `drop`), with src_dir's config and tokenizer
    (its files; not a folder beside them, such as a warm-start draft)."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(src_dir):
        path = os.path.join(src_dir, name)
        if os.path.isfile(path) and not name.startswith("model.safetensors"):
            shutil.copy(path, os.path.join(out_dir, name))
    kept = {n: t.float().contiguous() for n, t in tensors.items() if n not in drop}
    save_file(kept, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


class _Trainer:
    """Holds named tensor sets and one WeightSender; each public method is a command."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.tensors: dict[str, Tensors] = {}
        self.sender: WeightSender | None = None
        self.proxy: Any = None

    def load(self, key: str, model_path: str, seed: int, scale: float = 0.1,
             dtype: str = "float32", out_dir: str | None = None) -> None:
        self.tensors[key] = perturbed(model_path, seed, scale, dtype)
        if out_dir is not None:
            save_checkpoint(self.tensors[key], model_path, out_dir)

    def put(self, key: str, tensors: Tensors) -> None:
        self.tensors[key] = tensors

    def connect(self, address: tuple[str, int], authkey: bytes, master_port: int,
                bucket_bytes: int, timeout_s: float) -> None:
        self.proxy = EngineProxy(address, authkey, timeout_s=2 * timeout_s)
        self.sender = WeightSender("127.0.0.1", master_port, 2, backend="gloo",
                                   bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        self.sender.connect([self.proxy])

    def send(self, key: str, **kwargs: Any) -> dict:
        start = time.perf_counter()
        replies = self.sender.send(self.tensors[key], [self.proxy], **kwargs)
        return {"replies": replies, "seconds": time.perf_counter() - start}

    def close(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:  # after a failed broadcast the sender has dropped both sides
            sender.close([self.proxy] if sender.connected else [])

    def partial(self, key: str, master_port: int, group_name: str, count: int) -> None:
        """Rank 0 of a per-tensor update that stops after `count` tensors, then waits to die."""
        group = init_process_group("127.0.0.1", master_port, 0, 2, group_name, "gloo",
                                   timeout_s=60)
        for _, tensor in list(self.tensors[key].items())[:count]:
            group.broadcast(tensor.contiguous())
        self.conn.send(("ok", "sent"))
        time.sleep(3600)

    def raw(self, master_port: int, group_name: str, sizes: list[int], repeats: int = 1
            ) -> list[float]:
        """Seconds per round of plain broadcasts of buffers of `sizes` bytes, as rank 0."""
        group = init_process_group("127.0.0.1", master_port, 0, 2, group_name, "gloo",
                                   timeout_s=120)
        buffers = [torch.ones(n, dtype=torch.uint8) for n in sizes]
        group.broadcast(torch.zeros(1))  # both sides ready before the clock starts
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for buf in buffers:
                group.broadcast(buf)
            times.append(time.perf_counter() - start)
        group.destroy()
        return times


def _worker(conn: Any) -> None:
    torch.set_num_threads(1)
    trainer = _Trainer(conn)
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            return
        if command == "exit":
            return
        try:
            reply = ("ok", getattr(trainer, command)(**kwargs))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            reply = ("err", type(exc).__name__, str(exc))
        conn.send(reply)


class TrainerError(RuntimeError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class TrainerProcess:
    """A spawned trainer process: call(command, **kwargs) runs a _Trainer method there."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()  # a dead worker then reads as EOF here

    def call(self, command: str, wait_s: float = 60.0, **kwargs: Any) -> Any:
        self.start(command, **kwargs)
        return self.result(wait_s)

    def start(self, command: str, **kwargs: Any) -> None:
        self.conn.send((command, kwargs))

    def result(self, wait_s: float = 60.0) -> Any:
        if not self.conn.poll(wait_s):
            raise TimeoutError(f"the trainer did not answer within {wait_s}s")
        try:
            status, *payload = self.conn.recv()
        except EOFError:
            raise TrainerError("EOFError", "the trainer process died") from None
        if status == "ok":
            return payload[0]
        raise TrainerError(*payload)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("exit", {}))
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rpc-port", type=int, required=True)
    parser.add_argument("--authkey", required=True, help="hex")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, help="where rank 0 saves what it sent")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--version", default="trained-1")
    args = parser.parse_args()
    faulthandler.enable()  # an abort in C++ shows every thread's Python stack

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    before = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(before)
    result: dict[str, Any] = {}
    if rank == 0:
        tensors = perturbed(args.model, args.seed)
        save_checkpoint(tensors, args.model, args.out)
        engine = EngineProxy(("127.0.0.1", args.rpc_port), bytes.fromhex(args.authkey), 60)
        sender = WeightSender("127.0.0.1", free_port(), 2, backend="gloo", bucket_bytes=1 << 20,
                              timeout_s=30)
        result["replies"] = sender.send(tensors, [engine], weight_version=args.version)
        sender.close([engine])
    after = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(after)  # the default group still works
    if rank == 0:
        result.update(world_size=torch.distributed.get_world_size(),
                      sums=[before.item(), after.item()])
        print(json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()
    # Past this point only the interpreter's teardown runs, where torch's gloo threads can
    # abort the process (pytorch/pytorch#179291); what this script checks is done and printed.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
