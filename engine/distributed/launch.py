"""Where an Engine sits in a job: `launcher="spawn"` (alone) or `launcher="torchrun"` (SPMD).

Under `torchrun --nproc_per_node N` every rank constructs the Engine with the same arguments and
calls the same methods in the same order, as vLLM's external_launcher does. Ranks
`[k * tp_size, (k + 1) * tp_size)` form engine k; the engines are data parallel, so each samples
its own share: engine k runs with seed `seed + k` (a request's own `seed` is kept as given, so
that it stays reproducible). With tp_size=1 every rank is one whole engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.executor.model_runner import ModelRunner

LAUNCHERS = ("spawn", "torchrun")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Launch:
    launcher: str = "spawn"
    rank: int = 0  # this process's rank in the job (torchrun's RANK)
    world_size: int = 1
    local_rank: int = 0
    tp_size: int = 1

    @property
    def dp_rank(self) -> int:
        """Which engine of the job this process belongs to."""
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size


def resolve_launch(config: EngineConfig) -> tuple[EngineConfig, Launch]:
    """Checks tp_size, launcher and what tp_size rules out, reads torchrun's environment, and
    offsets the seed."""
    if config.launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {config.launcher!r}")
    if not isinstance(config.tp_size, int) or config.tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {config.tp_size!r}")
    if config.tp_size > 1 and config.weight_staging == "none":
        raise ValueError("weight_staging='none' is not available with tp_size > 1: every rank "
                         "receives an update beside its shards so that all or none commit")
    if config.tp_size > 1 and config.launcher == "torchrun":
        raise ValueError(f"tp_size={config.tp_size} with launcher='torchrun' is not available "
                         "in this build: use tp_size=1 per rank, or launcher='spawn'")
    if config.launcher == "spawn":
        return config, Launch(tp_size=config.tp_size)
    launch = _torchrun_launch(config.tp_size)
    if config.device == "cuda":
        torch.cuda.set_device(launch.local_rank)
    return replace(config, seed=config.seed + launch.dp_rank), launch


def make_runner(config: EngineConfig, model_config: ModelConfig) -> ModelRunner:
    """The Engine's model runner: tensor parallel (spawning its workers) when tp_size > 1."""
    if config.tp_size == 1:
        return ModelRunner(config, model_config)
    from hotswap.engine.distributed.tp_runner import TPModelRunner

    return TPModelRunner(config, model_config)


def _torchrun_launch(tp_size: int) -> Launch:
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise ValueError(f"launcher='torchrun' runs inside torchrun; the environment lacks "
                         f"{', '.join(missing)}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % tp_size:
        raise ValueError(f"torchrun's WORLD_SIZE {world} is not a multiple of tp_size {tp_size}")
    return Launch("torchrun", rank, world, int(os.environ["LOCAL_RANK"]), tp_size)
