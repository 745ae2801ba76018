"""Tensor parallelism over N processes: rank 0 is the Engine's own ModelRunner, ranks 1..N-1
are worker processes it spawns.

Every rank holds the ordinary model built from `shard_config` (its heads, its MLP columns),
its own KV pool for its KV heads, and the same slot numbering: the scheduler, the allocator and
the radix cache exist on rank 0 only. Each step rank 0 broadcasts the forward batch (with the
batch's rows of the req-to-token table) and every rank runs the forward, all-reducing after the
row-parallel projections and the vocab-parallel embedding; each rank's lm_head computes the logits
of its vocabulary rows and rank 0 gathers them and samples. Tensor and disk weight writes go
through rank 0's weight map, which takes full HF tensors, keeps rank 0's shard and broadcasts
the tensor to the workers, which slice their own; a trainer's process group is joined by every
rank, each receiving for itself (tp_weight_sync.py).

A worker that dies makes every forward and every new request raise WorkerDiedError; shutdown
stops the workers and kills any that do not exit.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
from dataclasses import replace
from typing import Any

import torch

from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.distributed.parallel_linear import make_row_parallel
from hotswap.engine.distributed.shard import shard_config, shard_tensor, unshard
from hotswap.engine.distributed.tp_group import TPGroup
from hotswap.engine.distributed.tp_weight_sync import (
    RankWeightSync,
    WeightSyncDriver,
    WeightSyncWorker,
)
from hotswap.engine.distributed.vocab_parallel import gather_logits, make_vocab_parallel
from hotswap.engine.errors import WorkerDiedError
from hotswap.engine.executor.model_runner import ModelRunner
from hotswap.engine.models import build_model
from hotswap.engine.models.loader import check_weights, iter_checkpoint, read_checkpoint_meta
from hotswap.weight_sync.group import free_port

_STOP_TIMEOUT_S = 10.0


class _TPRank(ModelRunner, RankWeightSync):
    """What every rank does: build its shard of the model and load its slices."""

    def _init_tp(self, config: EngineConfig, full: ModelConfig, tp_rank: int) -> None:
        self.full_config, self.tp_rank, self.tp_size = full, tp_rank, config.tp_size
        self.group: TPGroup | None = None  # joined by the caller; needed from the first forward
        self._init_weight_sync()
        with torch.device("meta"):  # shapes only: what a full checkpoint must hold
            full_model = build_model(full, config.context_length or 1)
        full_map = full_model.hf_weight_map()
        self.full_shapes = {n: tuple(s.view.shape) for n, s in full_map.items()}
        self.full_covers = {n: s.covers for n, s in full_map.items()}  # MoE aliases
        self.full_required = full_model.required_weight_names()
        ModelRunner.__init__(self, config, shard_config(full, config.tp_size))
        # The model holds a block of the vocabulary; the logits rank 0 returns cover all of it.
        self.model_config = replace(self.model_config, vocab_size=full.vocab_size)
        self.local_map = self.weight_map

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.group.all_reduce(tensor)

    def ready(self) -> None:
        """Every rank has loaded its shard (returns on all ranks together)."""
        self.group.all_reduce(torch.zeros(1, device=self.group.device))

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return gather_logits(super().forward(fb), self.full_config.vocab_size, self.group)

    def memory(self) -> dict[str, int]:
        """What this rank holds: parameter bytes and its rows of embedding and lm_head."""
        return {"param_bytes": sum(s.numel() for _, s in self._param_shapes) * self.dtype.itemsize,
                "embed_rows": self.local_map["model.embed_tokens.weight"].view.shape[0],
                "lm_head_rows": self.local_map["lm_head.weight"].view.shape[0]}

    def memory_all_ranks(self) -> list[dict[str, int]]:
        mine = self.memory()
        keys = sorted(mine)
        local = torch.tensor([mine[k] for k in keys], dtype=torch.int64, device=self.group.device)
        return [dict(zip(keys, t.tolist(), strict=True)) for t in self.group.all_gather(local)]

    def _load_weights(self) -> None:
        make_row_parallel(self.model, self)
        make_vocab_parallel(self.model, self.tp_rank, self)
        meta = read_checkpoint_meta(self.config.model_path)
        check_weights(_Shapes(self.full_shapes, self.full_covers), meta, self.full_required)
        local = self.model.hf_weight_map()
        with torch.no_grad():
            for name, tensor in iter_checkpoint(self.config.model_path):
                if name in local:
                    local[name].view.copy_(self.shard(name, tensor))

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return shard_tensor(name, full, self.full_config, self.tp_rank, self.tp_size)

    def set_local(self, name: str, full: torch.Tensor) -> None:
        with torch.no_grad():
            self.local_map[name].view.copy_(self.shard(name, full))

    def gather(self, name: str) -> torch.Tensor:
        shards = self.group.all_gather(self.local_map[name].view.contiguous())
        return unshard(name, shards, self.full_config)


class TPModelRunner(_TPRank, WeightSyncDriver):
    """Rank 0: the Engine's runner; spawns and commands the workers. A command and the
    collectives that follow it hold one lock: the scheduler's forwards and a trainer's update
    (an RPC thread) never interleave on the group."""

    tensor_parallel = True

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self._lock = threading.RLock()
        self.workers: list[mp.Process] = []
        self.dead: str | None = None
        self._init_tp(config, model_config, 0)
        # Workers size their KV pools like this one: the slot numbering is shared.
        worker_config = replace(config, max_total_tokens=self.allocator.size)
        port = free_port()
        ctx = mp.get_context("spawn")
        self.workers = [ctx.Process(target=worker_main, name=f"hotswap-tp{rank}", daemon=True,
                                    args=(worker_config, model_config, rank, port))
                        for rank in range(1, config.tp_size)]
        for worker in self.workers:
            worker.start()
        try:
            self.group = TPGroup(port, 0, config.tp_size, _backend(config))
            self.ready()
        except BaseException:
            self._kill_workers()
            raise
        self.weight_map = {n: ShardedWeight(self, n, self.full_shapes[n], s.view.dtype,
                                            s.covers)
                           for n, s in self.local_map.items()}
        self._wrap_kv_pool()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="hotswap-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            for rank, worker in enumerate(self.workers, start=1):
                if not worker.is_alive() and self.dead is None:
                    self.dead = (f"tensor-parallel worker {rank} of {self.tp_size} exited "
                                 f"(exit code {worker.exitcode}); the engine cannot run; "
                                 "shut it down and start a new one")

    def _exclusive(self) -> threading.RLock:
        return self._lock

    def check_alive(self) -> None:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)

    def _command(self, *cmd: Any) -> None:
        self.check_alive()
        try:
            self.group.send_object(cmd)
        except RuntimeError as exc:
            raise WorkerDiedError(f"tensor-parallel group failed: {exc}") from exc

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        width = max(fb.seq_lens_cpu)
        rows = self.req_to_token_pool.req_to_token[fb.req_pool_indices, :width]
        with self._lock:
            self._command("forward", replace(fb, attn_backend=None, rope=None,
                                             attn_metadata=None), rows)
            try:
                return super().forward(fb)
            except RuntimeError as exc:
                self.check_alive()
                raise WorkerDiedError(f"tensor-parallel forward failed: {exc}") from exc

    def set_weight(self, name: str, full: torch.Tensor) -> None:
        full = full.detach().to(self.group.device).contiguous()
        with self._lock:
            self.set_local(name, full)
            self._command("set", name, tuple(full.shape), full.dtype)
            self.group.broadcast(full)

    def gather_weight(self, name: str) -> torch.Tensor:
        with self._lock:
            self._command("gather", name)
            return self.gather(name)

    def memory_per_rank(self) -> list[dict[str, int]]:
        """Every rank's `memory()`, in rank order."""
        with self._lock:
            self._command("memory")
            return self.memory_all_ranks()

    def release_weights(self) -> None:
        with self._lock:
            self._command("release_weights")
            super().release_weights()

    def resume_weights(self) -> None:
        with self._lock:
            self._command("resume_weights")
            super().resume_weights()

    def _wrap_kv_pool(self) -> None:
        # The scheduler frees and reallocates rank 0's pool; the workers' pools follow it.
        pool, release, allocate = self.kv_pool, self.kv_pool.release, self.kv_pool.allocate

        def tp_release() -> None:
            with self._lock:
                self._command("kv_release")
                release()

        def tp_allocate() -> None:
            with self._lock:
                self._command("kv_allocate")
                allocate()

        pool.release, pool.allocate = tp_release, tp_allocate

    def shutdown(self) -> None:
        self._stop.set()
        if self.dead is None:
            with contextlib.suppress(RuntimeError):
                self.group.send_object(("stop",))
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        self._kill_workers()

    def _kill_workers(self) -> None:
        for worker in self.workers:
            if worker.is_alive():
                worker.kill()
            worker.join(5)


class ShardedWeight:
    """Rank 0's weight-map entry for one full HF tensor: `.view` takes full tensors (copy_),
    reads gather the shards (get_weights_by_name)."""

    device = torch.device("meta")  # never a direct receive destination

    def __init__(self, runner: TPModelRunner, name: str, shape: tuple[int, ...],
                 dtype: torch.dtype, covers: tuple[str, ...] = ()):
        self.runner, self.name, self.shape, self.dtype = runner, name, torch.Size(shape), dtype
        self.covers = covers  # as WeightSlot.covers

    @property
    def view(self) -> ShardedWeight:
        return self

    def copy_(self, full: torch.Tensor) -> ShardedWeight:
        if tuple(full.shape) != tuple(self.shape):
            raise ValueError(f"tensor {self.name!r} has shape {tuple(full.shape)}, "
                             f"expected {tuple(self.shape)}")
        self.runner.set_weight(self.name, full)
        return self

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.runner.gather_weight(self.name)[index]

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return 0


class TPWorkerRunner(_TPRank, WeightSyncWorker):
    def __init__(self, config: EngineConfig, model_config: ModelConfig, rank: int,
                 group: TPGroup):
        self._init_tp(config, model_config, rank)
        self.group = group
        self.ready()

    def serve(self) -> None:
        """Runs rank 0's commands until told to stop."""
        while True:
            op, *args = self.group.recv_object()
            if op == "stop":
                return
            getattr(self, f"_do_{op}")(*args)

    @torch.inference_mode()
    def _do_forward(self, fb: ForwardBatch, rows: torch.Tensor) -> None:
        self.req_to_token_pool.req_to_token[fb.req_pool_indices, :rows.shape[1]] = rows
        self.forward(fb)

    def _do_set(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        full = torch.empty(shape, dtype=dtype, device=self.group.device)
        self.group.broadcast(full)
        self.set_local(name, full)
        self.weights_changed()

    def _do_gather(self, name: str) -> None:
        self.gather(name)

    def _do_memory(self) -> None:
        self.memory_all_ranks()

    def _do_release_weights(self) -> None:
        self.release_weights()

    def _do_resume_weights(self) -> None:
        self.resume_weights()

    def _do_kv_release(self) -> None:
        self.kv_pool.release()

    def _do_kv_allocate(self) -> None:
        self.kv_pool.allocate()


def worker_main(config: EngineConfig, model_config: ModelConfig, rank: int, port: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tp_size))
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    if config.device == "cuda":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    group = TPGroup(port, rank, config.tp_size, _backend(config))
    TPWorkerRunner(config, model_config, rank, group).serve()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)  # the engine process is gone: nothing will command this worker again


class _Shapes(dict):
    """check_weights reads `.view.shape` and `.covers` of each entry."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], covers: dict[str, tuple[str, ...]]):
        super().__init__({n: _Shape(torch.Size(s), covers[n]) for n, s in shapes.items()})


class _Shape:
    def __init__(self, shape: torch.Size, covers: tuple[str, ...]):
        self.view = torch.empty(shape, device="meta")
        self.covers = covers


def _backend(config: EngineConfig) -> str:
    return "nccl" if config.device == "cuda" else "gloo"
