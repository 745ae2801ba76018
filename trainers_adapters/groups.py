"""Trainer-side process-group helpers under the names RL frameworks import, speaking hotswap's
weight-sync protocol (the store keys and ranks of hotswap.weight_sync.group).

Follows the call sites of:
- `init_custom_process_group(backend, init_method, world_size, rank, group_name)`: SGLang's
  helper as verl and slime (624b824, slime/utils/distributed_utils.py `init_process_group`)
  call it; the trainer is rank 0 and then runs `dist.broadcast(t, 0, group=group)`.
- `stateless_init_process_group(master_address, master_port, rank, world_size, device)`:
  OpenRLHF's helper (3c3be62, openrlhf/utils/distributed_util.py; vLLM's StatelessProcessGroup
  + PyNcclCommunicator underneath), used as `group.broadcast(t, src=0, stream=...)`.

SGLang's and vLLM's own helpers cannot meet hotswap's group: their store keys and prefixes
differ. Swap the import; the calls stay as they are. One broadcast per tensor in the order of
the names the engine was told is hotswap's per-tensor wire format (load_format None).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
from torch.distributed.distributed_c10d import _world

from hotswap.weight_sync.group import WeightGroup, init_process_group

# vLLM's stateless group has no name; both sides of an OpenRLHF-style group use this one.
STATELESS_GROUP_NAME = "stateless_weight_update_group"


def init_custom_process_group(backend: str | None = None, init_method: str | None = None,
                              timeout: timedelta | None = None, world_size: int = -1,
                              rank: int = -1, store: Any = None, group_name: str | None = None,
                              pg_options: Any = None) -> Any:
    """A process group that `torch.distributed.broadcast(t, src, group=...)` accepts and whose
    other ranks are hotswap engines joined with init_weights_update_group(group_name=...)."""
    if store is not None:
        raise ValueError("store: hotswap's group hosts its own store; give init_method")
    if not init_method or not init_method.startswith("tcp://"):
        raise ValueError(f"init_method must be 'tcp://host:port', got {init_method!r}")
    if not group_name:
        raise ValueError("group_name is required: the engines join the group by name")
    url = urlparse(init_method)
    group = init_process_group(url.hostname or "127.0.0.1", int(url.port or 0), rank,
                               world_size, group_name, backend or "auto",
                               timeout_s=(timeout or timedelta(minutes=10)).total_seconds())
    return _registered(group)


def _registered(group: WeightGroup) -> Any:
    """The group's backend, known to torch.distributed so that dist.broadcast takes it."""
    pg = group._pg  # noqa: SLF001 - the backend object is what dist.broadcast drives
    _world.pg_group_ranks[pg] = {i: i for i in range(group.world_size)}
    _OWNERS[id(pg)] = group
    return pg


_OWNERS: dict[int, WeightGroup] = {}  # id(backend) -> its group, for destroy_process_group


class HotswapCommunicator:
    """What PyNcclCommunicator offers a trainer: broadcast(tensor, src, stream)."""

    def __init__(self, group: WeightGroup):
        self.group = group
        self.rank = group.rank
        self.world_size = group.world_size
        self.device = group.device

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        if stream is not None and tensor.is_cuda:
            stream.synchronize()  # the tensor was written on `stream`; gloo/nccl read it now
        sendable = tensor if tensor.device == self.group.device else tensor.to(self.group.device)
        self.group.broadcast(sendable.contiguous(), src)
        if sendable is not tensor and self.rank != src:
            tensor.copy_(sendable)

    def destroy(self) -> None:
        self.group.destroy()


def stateless_init_process_group(master_address: str, master_port: int, rank: int,
                                 world_size: int, device: Any = None,
                                 backend: str = "auto") -> HotswapCommunicator:
    """OpenRLHF's helper (vLLM StatelessProcessGroup + PyNccl) over hotswap's group; the engines
    join it with the OpenRLHF adapter's init_process_group (or group_name=STATELESS_GROUP_NAME)."""
    group = init_process_group(master_address, master_port, rank, world_size,
                               STATELESS_GROUP_NAME, backend,
                               device=_as_device(device) if device is not None else None)
    return HotswapCommunicator(group)


def _as_device(device: Any) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def destroy_process_group(group: Any) -> None:
    """Destroys either kind of group this module hands out."""
    if isinstance(group, HotswapCommunicator):
        group.destroy()
        return
    _world.pg_group_ranks.pop(group, None)
    owner = _OWNERS.pop(id(group), None)
    if owner is not None:
        owner.destroy()
