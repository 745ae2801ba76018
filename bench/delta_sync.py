"""Delta vs full weight pushes after real optimizer steps (python bench/weight_sync.py --delta).

A spawned trainer process holds SmolLM2-135M in fp32 with AdamW and two WeightSenders over gloo
on localhost: one pushes the full weights into engine F, the other only what changed
(send(delta=True)) into engine D; both engines live in this process, in the same dtype. Per
learning rate: a first push of both (the delta sender's is full: it has no base yet), then
`repeats` rounds of one optimizer step on a language-model loss followed by the two pushes, in
alternating order. Printed per row: bytes on the wire, end-to-end seconds (send called -> the
engine serves the new version), the delta/full ratios, the share of elements that changed in
the engine's dtype, and how many of the delta sender's pushes went as deltas (it pushes in full
where its sampled estimate finds changes dense). After every round the two engines' weights are
compared bit for bit (a delta must give what a full push gives).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import time
from typing import Any

import torch

from hotswap.engine import Engine
from hotswap.weight_sync import WeightSender
from hotswap.weight_sync.group import free_port
from hotswap.weight_sync.rpc import EngineProxy, RpcClient, RpcServer

TRAINER_METHODS = ("load", "connect", "step", "push", "close")
DELTA_EXPOSED = ("init_weights_update_group", "update_weights_from_distributed",
                 "destroy_weights_update_group", "get_weight_version",
                 "prepare_weights_from_distributed", "commit_weight_update",
                 "abort_weight_update")


class _Proxy(EngineProxy):
    """An engine in the bench's process, with the dtype its weights are kept in."""

    def __init__(self, address: tuple[str, int], authkey: bytes, dtype: str):
        super().__init__(address, authkey, timeout_s=600)
        self.weights_dtype = dtype


class DeltaTrainer:
    def __init__(self) -> None:
        self.model: Any = None
        self.optim: Any = None
        self.senders: dict[str, tuple[WeightSender, _Proxy]] = {}

    def load(self, model_path: str, lr: float) -> None:
        import transformers

        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_path,
                                                                       dtype=torch.float32)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def connect(self, kind: str, address: tuple[str, int], authkey: bytes, dtype: str,
                master_port: int) -> None:
        proxy = _Proxy(address, authkey, dtype)
        sender = WeightSender("127.0.0.1", master_port, 2, group_name=kind, backend="gloo",
                              timeout_s=600)
        sender.connect([proxy])
        self.senders[kind] = (sender, proxy)

    def step(self, seed: int) -> float:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.model.config.vocab_size, (4, 64), generator=gen)
        loss = self.model(input_ids=ids, labels=ids).loss
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        return float(loss.detach())

    def push(self, kind: str) -> dict:
        sender, proxy = self.senders[kind]
        named = [(n, p.detach()) for n, p in self.model.named_parameters()]
        start = time.perf_counter()
        sender.send(named, [proxy], delta=kind == "delta")
        return {"seconds": time.perf_counter() - start, **sender.last_push}

    def close(self) -> None:
        for sender, proxy in self.senders.values():
            sender.close([proxy])
        self.senders.clear()


def _trainer_main(conn: Any) -> None:
    with RpcServer(DeltaTrainer(), exposed=TRAINER_METHODS) as server:
        conn.send((server.address, server.authkey))
        conn.recv()


def run(path: str, dtypes: list[str], lrs: list[float], repeats: int) -> None:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_trainer_main, args=(child,), daemon=True)
    proc.start()
    trainer = RpcClient(*conn.recv(), timeout_s=1200)
    print(f"model {path}; trainer fp32 AdamW; one push = every parameter "
          f"({repeats} rounds per row, medians; 'pairs': delta/full time per round)")
    print(f"{'engine':<10}{'lr':>8}{'full MB':>9}{'delta MB':>10}{'bytes':>7}{'full s':>8}"
          f"{'delta s':>9}{'time':>7}{'pairs':>12}{'changed':>9}{'as delta':>10}")
    for dtype in dtypes:
        for lr in lrs:
            row = _measure(trainer, path, dtype, lr, repeats)
            print(f"{dtype:<10}{lr:>8.0e}{row['full_mb']:>9.1f}{row['delta_mb']:>10.2f}"
                  f"{row['delta_mb'] / row['full_mb']:>6.3f}x{row['full_s']:>8.3f}"
                  f"{row['delta_s']:>9.3f}{row['delta_s'] / row['full_s']:>6.2f}x"
                  f"{row['pairs']:>12}{row['changed']:>9.2%}{row['sent']:>10}")
    conn.send("stop")
    proc.join(30)


def _measure(trainer: RpcClient, path: str, dtype: str, lr: float, repeats: int) -> dict:
    trainer.call("load", model_path=path, lr=lr)
    engines = {k: Engine(path, dtype=dtype, max_total_tokens=4096) for k in ("full", "delta")}
    servers = {k: RpcServer(e, exposed=DELTA_EXPOSED) for k, e in engines.items()}
    for kind, server in servers.items():
        port = free_port()
        joined = threading.Thread(target=trainer.call, args=("connect",), kwargs=dict(
            kind=kind, address=server.address, authkey=server.authkey, dtype=dtype,
            master_port=port))
        joined.start()
        joined.join(600)
    for kind in servers:
        trainer.call("push", kind=kind)  # the delta sender's first push is full: no base yet
    rounds: dict[str, list[dict]] = {"full": [], "delta": []}
    for i in range(repeats):
        trainer.call("step", seed=i)
        for kind in ("full", "delta") if i % 2 == 0 else ("delta", "full"):
            rounds[kind].append(trainer.call("push", kind=kind))
        for name, slot in engines["full"].runner.weight_map.items():
            assert torch.equal(slot.view, engines["delta"].runner.weight_map[name].view), name
    trainer.call("close")
    for kind in servers:
        servers[kind].close()
        engines[kind].shutdown()
    pairs = sorted(d["seconds"] / f["seconds"] for d, f in zip(rounds["delta"], rounds["full"]))
    return {"full_mb": statistics.median(r["bytes"] for r in rounds["full"]) / 1e6,
            "delta_mb": statistics.median(r["bytes"] for r in rounds["delta"]) / 1e6,
            "full_s": statistics.median(r["seconds"] for r in rounds["full"]),
            "delta_s": statistics.median(r["seconds"] for r in rounds["delta"]),
            "pairs": f"{pairs[0]:.2f}-{pairs[-1]:.2f}",
            "changed": statistics.median(r["changed_fraction"] for r in rounds["delta"]),
            "sent": f"{sum(r['kind'] == 'delta' for r in rounds['delta'])}/{repeats}"}
