"""verl's `BaseRollout` for hotswap: the training worker's side, which only moves weights.

Follows verl 0.9.1: workers/rollout/base.py (`BaseRollout`, `_ROLLOUT_REGISTRY`),
workers/engine_workers.py (`ActorRolloutRefWorker.update_weights`: `resume(["weights"])`,
`update_weights(per_tensor_param, peft_config=, base_sync_done=, global_steps=)`,
`resume(["kv_cache"])`) and checkpoint_engine/base.py (`CheckpointEngineWorker`, which builds
the rollout with `replica_rank=` and passes `wire_format=`).

Every training rank iterates the weights (FSDP gathers each tensor collectively); the first rank
of each replica's ranks sends them to its server actor in buckets of
`checkpoint_engine.update_weights_bucket_megabytes`, through Ray's object store, staged on the
server while it holds generation. Then the ranks agree (an all-reduce on verl's process group):
if every replica staged its update, each commits it as one version labelled with verl's
`global_steps`; if any failed, every replica drops its stage and the call raises. Weights go
through host memory, also on GPUs (no CUDA IPC, no NCCL path here).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch

DEFAULT_BUCKET_MB = 512
SERVER_NAME = "hotswap_server_{replica}_{node}"

try:
    from verl.workers.rollout.base import BaseRollout as _Base
except ImportError:  # verl absent: the adapter still works against a server handle
    _Base = object  # type: ignore[assignment, misc]


class HotswapRollout(_Base):  # type: ignore[misc, valid-type]
    """What verl's training worker holds as its rollout: `server=` is a HotswapServer actor
    handle (tests); by default it is looked up by name, as verl's SGLang adapter does."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None,
                 replica_rank: int = -1, *, server: Any = None):
        if _Base is object:
            self.config, self.model_config, self.device_mesh = config, model_config, device_mesh
        else:
            super().__init__(config, model_config, device_mesh)
        world = (_get(self.config, "tensor_model_parallel_size", 1)
                 * _get(self.config, "data_parallel_size", 1)
                 * _get(self.config, "pipeline_model_parallel_size", 1))
        rank = int(os.environ.get("RANK", "0"))
        local_world = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", str(world)))
        self.replica_rank = rank // world if replica_rank < 0 else replica_rank
        self.rollout_rank = rank % world
        self.node_rank = self.rollout_rank // local_world
        self.is_leader_rank = self.rollout_rank == 0  # one sender per replica
        self._server = server

    def server(self) -> Any:
        if self._server is None and self.is_leader_rank:
            import ray

            self._server = ray.get_actor(SERVER_NAME.format(replica=self.replica_rank,
                                                            node=self.node_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if self.is_leader_rank and _get(self.config, "free_cache_engine", True):
            await self.server().resume_memory.remote(list(tags))

    async def release(self) -> None:
        if self.is_leader_rank and _get(self.config, "free_cache_engine", True):
            await self.server().release_memory.remote(["kv_cache", "weights"])

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator,
                             wire_format: str = "named_tensors", global_steps: int | None = None,
                             peft_config: Any = None, base_sync_done: bool = True,
                             **kwargs: Any) -> None:
        """One version per call, on every replica or none (module docstring)."""
        if wire_format != "named_tensors":
            raise ValueError(f"wire_format {wire_format!r}: hotswap takes full named tensors "
                             "(checkpoint_engine.backend 'naive' or a full-tensor engine); "
                             "delta flushes are not supported")
        if peft_config is not None:
            raise ValueError("LoRA adapter sync is not supported: set "
                             "actor_rollout_ref.model.lora.merge=True to push merged weights")
        server, error = None, None
        try:
            server = self.server()
        except Exception as exc:  # still iterate and vote below: the other ranks wait on us
            error = f"server actor of replica {self.replica_rank} not found: {exc}"
        error = await self._stage(weights, server) or error
        if not await _all_ranks(error is None):
            if server is not None:
                await server.abort_weights.remote()
            raise RuntimeError("weight update refused, no replica moved: "
                               f"{error or 'another replica failed to stage it'}")
        if server is not None:
            version = None if global_steps is None else str(global_steps)
            out = await server.commit_weights.remote(version)
            if not out["success"]:
                raise RuntimeError(f"weight commit failed on replica {self.replica_rank}: "
                                   f"{out['message']}")

    async def _stage(self, weights: Any, server: Any) -> str | None:
        """Sends every bucket (all ranks iterate, only a leader sends); the first error."""
        limit = int(_get(_get(self.config, "checkpoint_engine"), "update_weights_bucket_megabytes",
                         DEFAULT_BUCKET_MB)) << 20
        error: str | None = None
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        async for name, tensor in _aiter(weights):
            if server is None or error is not None:
                continue  # keep iterating: the other ranks' gathers need this one
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > limit:
                error = await _send(server, bucket)
                bucket, size = [], 0
            bucket.append((name, tensor.detach().to("cpu")))
            size += nbytes
        if bucket and error is None:
            error = await _send(server, bucket)
        return error

    def generate_sequences(self, prompts: Any) -> Any:
        """verl 0.9's async rollout never calls this: its agent loops generate through the
        server actors (HotswapServer.generate). A caller that does gets a clear refusal."""
        raise TypeError("rollout.name=hotswap generates through its server actors (verl's agent "
                        "loops, rollout.mode=async); the training worker's rollout only moves "
                        "weights")


async def _send(server: Any, bucket: list[tuple[str, torch.Tensor]]) -> str | None:
    try:
        out = await server.stage_weights.remote(bucket)
    except Exception as exc:  # a ValueError from validation arrives as a Ray task error
        return f"{type(exc).__name__}: {exc}"
    return None if out["success"] else out["message"]


async def _all_ranks(ok: bool) -> bool:
    """True when every rank of verl's process group is ok (always when there is one rank)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    await asyncio.to_thread(dist.all_reduce, flag, dist.ReduceOp.MIN)
    return bool(flag.item())


async def _aiter(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if obj is None:
        return default
    value = obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)
    return default if value is None else value
