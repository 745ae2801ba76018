"""Named process groups for weight transfer, built directly on a TCPStore.

They never touch torch.distributed's default group or its group registry, so they coexist with a
torchrun job's default group and with each other. Rank 0 (the trainer) hosts the store.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0
BACKENDS = ("gloo", "nccl")
# NCCL's own watchdog fires this much later than our wait, so our error (not a crash) comes first.
_NCCL_WATCHDOG_SLACK_S = 60.0


class WeightSyncError(RuntimeError):
    """A transfer, a group or a target failed; `failures` maps each failed target to why."""

    def __init__(self, message: str, failures: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


def resolve_backend(backend: str, device: torch.device | str | None = None) -> str:
    """"auto" is nccl when CUDA exists and the tensors (if known) live on it, else gloo."""
    if backend in BACKENDS:
        return backend
    if backend != "auto":
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'gloo' or 'nccl'")
    on_cuda = device is None or torch.device(device).type == "cuda"
    return "nccl" if torch.cuda.is_available() and on_cuda else "gloo"


class WeightGroup:
    """One rank's membership in a named group. Broadcast is the only collective weights need."""

    def __init__(
        self, name: str, rank: int, world_size: int, backend: str, timeout_s: float,
        store: dist.Store, pg: dist.Backend, device: torch.device | None = None,
    ) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._store = store
        self._pg: dist.Backend | None = pg
        self._device = device or group_device(backend)

    @property
    def device(self) -> torch.device:
        """Where tensors must live to be broadcast: the GPU NCCL connected on, or the CPU."""
        return self._device

    @property
    def alive(self) -> bool:
        return self._pg is not None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In place: src's tensor lands in every rank's tensor (contiguous, on self.device).

        Raises WeightSyncError when a peer dies or stays silent past timeout_s.
        """
        self.wait(self.broadcast_start(tensor, src))

    def broadcast_start(self, tensor: torch.Tensor, src: int = 0) -> dist.Work | None:
        """Start a broadcast and return its handle (None when there is nothing to send); the
        tensor must stay untouched until `wait` returns."""
        if self._pg is None:
            raise WeightSyncError(f"group {self.name!r} (rank {self.rank}) is destroyed")
        if tensor.numel() == 0:
            return None
        if not tensor.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        # Bytes on the wire: the backends then need no support for the dtype itself.
        payload = tensor.reshape(-1).view(torch.uint8)
        try:
            return self._pg.broadcast([payload], opts)
        except RuntimeError as err:
            raise self._failed(err) from err

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Point to point: `tensor`'s bytes to rank `dst`, matched by `tag` (several transfers
        may be in flight between two ranks)."""
        self.wait(self._p2p("send", tensor, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        """In place: the bytes rank `src` sends with `tag` land in `tensor`."""
        self.wait(self._p2p("recv", tensor, src, tag))

    def _p2p(self, op: str, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work | None:
        if self._pg is None:
            raise WeightSyncError(f"group {self.name!r} (rank {self.rank}) is destroyed")
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"peer rank {peer}: not another rank of {self.name!r} "
                             f"(world size {self.world_size}, this rank {self.rank})")
        if tensor.numel() == 0:
            return None
        payload = tensor.reshape(-1).view(torch.uint8)
        try:
            return getattr(self._pg, op)([payload], peer, tag)
        except RuntimeError as err:
            raise self._failed(err) from err

    def wait(self, work: dist.Work | None) -> None:
        if work is None:
            return
        try:
            self._wait(work)
        except RuntimeError as err:
            raise self._failed(err) from err

    def _failed(self, err: Exception) -> WeightSyncError:
        return WeightSyncError(f"transfer on group {self.name!r} (rank {self.rank}) failed: {err}")

    def _wait(self, work: dist.Work) -> None:
        if self.backend == "gloo":
            work.wait()  # gloo enforces the group timeout and sees closed sockets at once
            return
        # NCCL's wait only orders streams; poll so a dead peer cannot block this thread forever.
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.destroy()
                raise WeightSyncError(f"broadcast timed out after {self.timeout_s:.0f}s")
            time.sleep(0.0005)
        work.wait()

    def destroy(self) -> None:
        """Drops this rank's side. Freeing the backend closes its sockets, so peers fail fast."""
        with _LOCK:
            if _GROUPS.get((self.name, self.rank)) is self:
                del _GROUPS[(self.name, self.rank)]
        pg, self._pg = self._pg, None
        if pg is not None:
            # Stop the backend's threads now, in this thread: left to the last reference (a
            # work handle, the interpreter's teardown) they may be destroyed still running.
            if self.backend == "nccl":
                pg.abort()
            else:
                pg.shutdown()
        self._store = None


_GROUPS: dict[tuple[str, int], WeightGroup | None] = {}  # None: being created
_LOCK = threading.Lock()


def init_process_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device: torch.device | str | None = None,
) -> WeightGroup:
    """Joins (rank 0: hosts) the named group; blocks until every rank has joined or timeout_s.

    Registered under (group_name, rank): one process may hold several ranks of one group (an
    in-process trainer and engine) and several groups.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    backend = resolve_backend(backend, device)
    key = (group_name, rank)
    with _LOCK:
        if key in _GROUPS:
            raise ValueError(f"group {group_name!r} rank {rank} exists; destroy it first")
        _GROUPS[key] = None
    try:
        group = _create(master_address, master_port, rank, world_size, group_name, backend,
                        timeout_s, group_device(backend, device))
    except BaseException:
        with _LOCK:
            _GROUPS.pop(key, None)
        raise
    with _LOCK:
        _GROUPS[key] = group
    return group


def _create(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
    backend: str, timeout_s: float, device: torch.device,
) -> WeightGroup:
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        pg = _nccl_backend(prefixed, rank, world_size, timeout_s, device)
    return WeightGroup(group_name, rank, world_size, backend, timeout_s, store, pg, device)


def group_device(backend: str, device: torch.device | str | None = None) -> torch.device:
    """The CPU for gloo; for NCCL the given CUDA device, else this thread's current one (a
    scheduler thread's current device need not be its engine's)."""
    if backend != "nccl":
        return torch.device("cpu")
    cuda = torch.device(device) if device is not None else None
    if cuda is not None and cuda.type == "cuda" and cuda.index is not None:
        return cuda
    return torch.device("cuda", torch.cuda.current_device())


def _nccl_backend(store: dist.Store, rank: int, world_size: int, timeout_s: float,
                  device: torch.device) -> dist.Backend:
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timedelta(seconds=timeout_s + _NCCL_WATCHDOG_SLACK_S)
    pg = ProcessGroupNCCL(store, rank, world_size, options)
    # NCCL connects lazily; connecting now makes a bad peer fail here, not in the first update.
    if hasattr(pg, "eager_connect_single_device"):
        pg.eager_connect_single_device(device)
    return pg


def get_group(group_name: str, rank: int | None = None) -> WeightGroup:
    """The group of that name held by this process; rank picks one when it holds several."""
    found = _find(group_name, rank)
    if not found:
        raise KeyError(f"no weight-update group {group_name!r}" +
                       ("" if rank is None else f" with rank {rank}"))
    return found[0]


def destroy_group(group_name: str, rank: int | None = None) -> bool:
    """Destroys the group and unregisters it; False when there was none."""
    found = _find(group_name, rank)
    if found:
        found[0].destroy()
    return bool(found)


def _find(group_name: str, rank: int | None) -> list[WeightGroup]:
    with _LOCK:
        found = [g for (name, r), g in _GROUPS.items()
                 if name == group_name and g is not None and rank in (None, r)]
    if len(found) > 1:
        raise KeyError(f"this process holds ranks {[g.rank for g in found]} of {group_name!r}; "
                       "pass rank")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for a group's master or a test server)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
