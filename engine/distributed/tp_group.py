"""The process group of one tensor-parallel engine: all-reduce for the forward, broadcast for
rank 0's commands and weights. torch.distributed's gloo (CPU) or NCCL (CUDA) backend on its own
TCPStore, so it never touches a torchrun job's default group."""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Workers wait for rank 0's next command as long as the engine idles; a dead peer is seen at
# once (closed sockets), so the timeout only bounds a peer that hangs.
IDLE_TIMEOUT = timedelta(days=7)


class TPGroup:
    def __init__(self, port: int, rank: int, world_size: int, backend: str = "gloo",
                 host: str = "127.0.0.1"):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self._store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                                    timeout=timedelta(seconds=120), wait_for_workers=False)
        store = dist.PrefixStore("hotswap-tp", self._store)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, IDLE_TIMEOUT)
        else:
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = IDLE_TIMEOUT
            self._pg = ProcessGroupNCCL(store, rank, world_size, options)
        self.device = torch.device("cpu") if backend == "gloo" else torch.device(
            "cuda", torch.cuda.current_device())

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """In place: the sum over ranks (the row-parallel layers' partial products)."""
        self._pg.allreduce([tensor]).wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._pg.allgather([out], [tensor.contiguous()]).wait()
        return out

    def exchange(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order, on every rank (outcomes to agree on)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.all_gather(torch.tensor([data.numel()], dtype=torch.int64).to(self.device))
        padded = torch.zeros(max(int(s.item()) for s in sizes), dtype=torch.uint8)
        padded[:data.numel()] = data
        parts = self.all_gather(padded.to(self.device))
        return [pickle.loads(p[:int(s.item())].cpu().numpy().tobytes())
                for p, s in zip(parts, sizes, strict=True)]

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 gets every rank's tensor (the same shape on all ranks); the others None."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty_like(tensor) for _ in range(self.world_size)]] if self.rank == 0 else []
        self._pg.gather(out, [tensor.contiguous()], opts).wait()
        return out[0] if self.rank == 0 else None

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's tensor into every rank's (contiguous, same shape and dtype)."""
        if tensor.numel():
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self._pg.broadcast([tensor.reshape(-1).view(torch.uint8)], opts).wait()

    def send_object(self, obj: Any) -> None:
        """Rank 0: one picklable command to every worker."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.broadcast(torch.tensor([data.numel()], dtype=torch.int64).to(self.device))
        self.broadcast(data.to(self.device))

    def recv_object(self) -> Any:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(data)
        return pickle.loads(data.cpu().numpy().tobytes())
