"""LoRAPool: device memory for up to max_loras_per_batch adapters, reused LRU.

Every loaded adapter keeps its weights on the host (LoRAAdapter); a step's adapters are copied
into pool slots before its forward. A slot whose adapter no step has used for longest is the one
overwritten when a new adapter needs room (never one the current step uses). Buffers are stacked
over slots so one batched matmul serves every adapter of a step:

    A[kind]   [slots, layers, len(targets) * rank, in_features]   (targets of a kind side by side)
    B[target] [slots, layers, out_features, rank]                 (scaling already folded in)

The rank dimension is the largest rank loaded so far (at most max_lora_rank): smaller adapters
are zero-padded, and the buffers grow (emptying the pool) when a larger adapter arrives.
`release()` frees the buffers with the model's weights (release_memory_occupation) and
`resume()` reallocates them empty; the host copies refill them as steps use the adapters.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from hotswap.engine.config import ModelConfig
from hotswap.engine.lora.adapter import LoRAAdapter, target_shapes

# Projections that share one input: their A matrices are applied in one matmul.
KINDS: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                     "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
KIND_OF = {t: kind for kind, targets in KINDS.items() for t in targets}


class LoRAPool:
    def __init__(self, model: ModelConfig, num_slots: int, device: torch.device,
                 dtype: torch.dtype):
        self.model = model
        self.num_slots = num_slots
        self.device = device
        self.dtype = dtype
        self.rank = 0
        self.released = False  # buffers freed; reserve() only records the rank until resume()
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._version: dict[str, int] = {}
        self.uploads = 0  # adapters copied into a slot (tests and metrics read it)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a.values(), *self.b.values()))

    def reserve(self, rank: int) -> None:
        """Make the buffers hold rank `rank`; growing them empties every slot."""
        if rank <= self.rank:
            return
        self.rank = rank
        self._slot_of.clear()
        self._version.clear()
        if not self.released:
            self._allocate()

    def _allocate(self) -> None:
        rank = self.rank
        shapes, layers, n = target_shapes(self.model), self.model.num_layers, self.num_slots
        self.a = {kind: torch.zeros(n, layers, len(targets) * rank, shapes[targets[0]][0],
                                    dtype=self.dtype, device=self.device)
                  for kind, targets in KINDS.items()}
        self.b = {t: torch.zeros(n, layers, shapes[t][1], rank, dtype=self.dtype,
                                 device=self.device) for t in shapes}

    def release(self) -> None:
        """Free the buffers; every slot is forgotten (the adapters keep their host copies)."""
        self.released = True
        self.a, self.b = {}, {}
        self._slot_of.clear()
        self._version.clear()

    def resume(self) -> None:
        if self.released:
            self.released = False
            if self.rank:
                self._allocate()

    def evict(self, name: str) -> None:
        """Forget `name`'s slot (its adapter was replaced or unloaded)."""
        self._slot_of.pop(name, None)
        self._version.pop(name, None)

    def ensure(self, adapters: list[LoRAAdapter]) -> dict[str, int]:
        """Slots holding the current version of every adapter given (at most num_slots)."""
        if len(adapters) > self.num_slots:
            raise ValueError(f"{len(adapters)} adapters in one step; max_loras_per_batch is "
                             f"{self.num_slots}")
        wanted = {a.name for a in adapters}
        for adapter in adapters:
            slot = self._slot_of.get(adapter.name)
            if slot is None or self._version[adapter.name] != adapter.version:
                slot = self._take_slot(wanted) if slot is None else slot
                self._write(slot, adapter)
                self._slot_of[adapter.name] = slot
                self._version[adapter.name] = adapter.version
            self._slot_of.move_to_end(adapter.name)
        return {a.name: self._slot_of[a.name] for a in adapters}

    def _take_slot(self, keep: set[str]) -> int:
        used = set(self._slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if free:
            return free[0]
        victim = next(n for n in self._slot_of if n not in keep)  # LRU among the unused
        slot = self._slot_of[victim]
        self.evict(victim)
        return slot

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for buf in (*self.a.values(), *self.b.values()):
            buf[slot].zero_()
        r = adapter.rank
        for (layer, target), (a, b) in adapter.weights.items():
            kind = KIND_OF[target]
            start = KINDS[kind].index(target) * self.rank
            self.a[kind][slot, layer, start: start + r].copy_(a)
            self.b[target][slot, layer, :, :r].copy_(b)
        self.uploads += 1
