"""A CPU platform for verl 0.9 (verl/plugin/platform), registered as "cpu": `VERL_PLATFORM=cpu`.

verl looks every device call up through its platform (device name, torch device module, the
collective backend, the Ray resource that stands for one device). On a CPU-only machine that
lets verl's FSDP2 actor train on "cpu" with gloo, one training rank per Ray "GPU" slot: start
Ray with as many logical GPUs as ranks (`+ray_kwargs.ray_init.num_gpus=N`); nothing binds them
to hardware. Useful to debug an RL job on a laptop; docs/rl.md#hotswap-in-verl has the rest.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformBase

NAME = "cpu"


class _CpuDeviceModule(ModuleType):
    """`torch.cpu` plus the torch.cuda calls verl makes on its device module, as host no-ops."""

    def __init__(self) -> None:
        super().__init__("hotswap_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, pages * page

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    get_rng_state = staticmethod(lambda device=None: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, device=None: torch.set_rng_state(state))
    manual_seed = manual_seed_all = staticmethod(lambda seed: torch.manual_seed(seed))


class PlatformCPU(PlatformBase):
    """verl's platform interface on the host: device "cpu", collectives over gloo."""

    _module = _CpuDeviceModule()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: chosen with VERL_PLATFORM=cpu

    def current_device(self) -> str:  # type: ignore[override]
        # verl moves tensors with .to(get_device_id()); an index would mean an accelerator
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # what Ray sets for its "GPU" slots; nothing reads it here

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"  # verl sizes its pools in Ray "GPU"s; on CPU each is one training rank

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _single_cpu_backend(init: Callable[..., Any]) -> Callable[..., Any]:
    """verl 0.9.1 builds the backend "cpu:gloo,{device}:{backend}" (utils/distributed.py), which
    torch refuses when the device is cpu ("Duplicate device type cpu"); pass plain gloo then."""

    @functools.wraps(init)
    def wrapper(timeout_second: Any = None, backend: str | None = None) -> Any:
        return init(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    wrapper.__hotswap_cpu__ = True  # type: ignore[attr-defined]
    return wrapper


def register() -> None:
    """Adds the platform to verl's PlatformRegistry. When it is the selected platform
    (VERL_PLATFORM=cpu), also gives verl's process-group setup a valid CPU backend string."""
    from verl.plugin.platform import PlatformRegistry
    from verl.utils import distributed

    if PlatformRegistry.get(NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=NAME)(PlatformCPU)
    if os.environ.get("VERL_PLATFORM", "").strip().lower() != NAME:
        return
    init = distributed.initialize_global_process_group_ray
    if not getattr(init, "__hotswap_cpu__", False):
        distributed.initialize_global_process_group_ray = _single_cpu_backend(init)
