"""LoRAManager: the loaded adapters, their versions, and adapter updates as transactions.

Loading or replacing an adapter is validated (config, every name and shape) in the caller's
thread; then, in the scheduler thread between steps, the running requests that use that adapter
are handled per pause mode, the adapter is swapped, its version is bumped, and only its cache
namespaces are retired: base-model KV and other adapters' KV stay cached (DESIGN invariant 1,
with the namespace's (adapter_name, adapter_version) fields).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import closing
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from hotswap.engine.client.protocol import check_pause_mode
from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.core.namespace import Namespace
from hotswap.engine.core.request import FinishReason, Req
from hotswap.engine.lora.adapter import (
    LoRAAdapter,
    LoRAConfig,
    build_adapter,
    check_tensor_meta,
    read_peft_folder,
)
from hotswap.engine.lora.batch import LoRABatch
from hotswap.engine.lora.pool import KIND_OF, LoRAPool
from hotswap.weight_sync.receiver import discard_tensors, receive_tensors

if TYPE_CHECKING:
    from hotswap.weight_sync.group import WeightGroup

T = TypeVar("T")


class SchedulerControls(Protocol):
    """The scheduler's control methods this manager uses (scheduler/control.py). Declared here
    because the scheduler imports this module: lora never imports the scheduler."""

    def run(self, fn: Callable[[], T]) -> T: ...

    def finish_where(self, picked: Callable[[Req], bool], reason: FinishReason,
                     queued: bool = True) -> int: ...

    def retract_where(self, picked: Callable[[Req], bool]) -> int: ...

    def retire_namespaces(self, retired: Callable[[Namespace], bool]) -> None: ...


class LoRAManager:
    def __init__(self, config: EngineConfig, model: ModelConfig, device: torch.device,
                 dtype: torch.dtype):
        if config.max_lora_rank < 1 or config.max_loras_per_batch < 1:
            raise ValueError("max_lora_rank and max_loras_per_batch must be >= 1")
        self.model = model
        self.max_rank = config.max_lora_rank
        self.max_per_batch = config.max_loras_per_batch
        self.dtype = dtype
        self.device = device
        self.pool = LoRAPool(model, config.max_loras_per_batch, device, dtype)
        self.adapters: dict[str, LoRAAdapter] = {}
        self._versions: dict[str, int] = {}  # kept after unload: a reload never reuses a version
        self.scheduler: SchedulerControls | None = None

    def attach(self, scheduler: SchedulerControls) -> None:
        self.scheduler = scheduler

    # reads (any thread)

    def has(self, name: str) -> bool:
        return name in self.adapters

    def version(self, name: str | None) -> int:
        return 0 if name is None else self._versions.get(name, 0)

    def check_name(self, name: str | None) -> None:
        if name is not None and name not in self.adapters:
            loaded = sorted(self.adapters) or "none"
            raise ValueError(f"lora_name {name!r} is not a loaded LoRA adapter (loaded: {loaded})")

    # loading and replacing (caller thread validates, scheduler thread commits)

    def load_from_path(self, name: str, path: str, pause_mode: str) -> dict:
        config, tensors = read_peft_folder(path)
        return self.load_from_tensors(name, tensors, config, pause_mode)

    def load_from_tensors(self, name: str, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping,
                          config_dict: Mapping[str, Any], pause_mode: str) -> dict:
        check_pause_mode(pause_mode)
        adapter = build_adapter(name, tensors, config_dict, self.model, self.max_rank,
                                self.dtype)
        return self.scheduler.run(lambda: self._commit(adapter, pause_mode))

    def update_from_distributed(self, name: str, group: WeightGroup, names: Sequence[str],
                                dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                                load_format: str | None, pause_mode: str,
                                config_dict: Mapping[str, Any] | None = None) -> dict:
        """A trainer's broadcast of an adapter's PEFT-named tensors replaces the adapter.

        Without config_dict the adapter must be loaded already and keeps its config.
        """
        try:
            check_pause_mode(pause_mode)
            config = self._config_for(name, config_dict)
            for n, shape in zip(names, shapes):
                check_tensor_meta(n, tuple(shape), LoRAConfig.from_dict(config, self.max_rank),
                                  self.model)
        except ValueError:
            discard_tensors(group, names, dtypes, shapes, load_format)  # the sender finishes
            raise
        with closing(receive_tensors(group, names, dtypes, shapes, load_format,
                                     device=self.device)) as received:
            tensors = [(n, t.clone()) for n, t in received]
        return self.load_from_tensors(name, tensors, config, pause_mode)

    def _config_for(self, name: str, config_dict: Mapping[str, Any] | None) -> dict[str, Any]:
        if config_dict is not None:
            return dict(config_dict)
        self.check_name(name)
        c = self.adapters[name].config
        return {"r": c.rank, "lora_alpha": c.alpha, "target_modules": list(c.targets),
                "use_rslora": c.use_rslora}

    def unload(self, name: str) -> dict:
        self.check_name(name)
        return self.scheduler.run(lambda: self._unload_now(name))

    # scheduler thread

    def _commit(self, adapter: LoRAAdapter, pause_mode: str) -> dict:
        sched, name = self.scheduler, adapter.name
        if pause_mode == "abort":
            reason = FinishReason.aborted("adapter_replaced",
                                          f"aborted: LoRA adapter {name!r} was replaced")
            sched.finish_where(_uses(name), reason, queued=False)
        elif pause_mode == "retract":
            sched.retract_where(_uses(name))
        version = self._versions.get(name, 0) + 1
        adapter.version = self._versions[name] = version
        self.adapters[name] = adapter
        self.pool.reserve(adapter.rank)
        self.pool.evict(name)
        self._retire(name, keep=version)
        return {"success": True, "message": f"loaded LoRA adapter {name!r} version {version}",
                "lora_name": name, "adapter_version": version}

    def _unload_now(self, name: str) -> dict:
        self.check_name(name)
        reason = FinishReason.aborted("adapter_unloaded",
                                      f"aborted: LoRA adapter {name!r} was unloaded")
        self.scheduler.finish_where(_uses(name), reason)
        del self.adapters[name]
        self.pool.evict(name)
        self._retire(name, keep=None)
        return {"success": True, "message": f"unloaded LoRA adapter {name!r}"}

    def _retire(self, name: str, keep: int | None) -> None:
        self.scheduler.retire_namespaces(
            lambda ns: ns.adapter_name == name and ns.adapter_version != keep)

    def admissible(self, req: Req, active: set[str]) -> bool:
        """Whether `req` fits a step whose adapters are `active` (max_loras_per_batch)."""
        return (req.lora_name is None or req.lora_name in active
                or len(active) < self.max_per_batch)

    def prepare(self, names: Sequence[str | None], extends: Sequence[int]) -> LoRABatch | None:
        """The step's segment metadata for rows using adapters `names` (None: the base model)
        over `extends` tokens each, its adapters resident in the pool; None if no row uses an
        adapter."""
        used = list(dict.fromkeys(n for n in names if n is not None))
        if not used:
            return None
        adapters = [self.adapters[n] for n in used]
        slot_of = self.pool.ensure(adapters)
        kinds = frozenset(KIND_OF[t] for a in adapters for t in a.config.targets)
        return LoRABatch.build(self.pool, [-1 if n is None else slot_of[n] for n in names],
                               list(extends), kinds)


def _uses(name: str) -> Callable[[Req], bool]:
    return lambda req: req.lora_name == name



