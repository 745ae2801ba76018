"""Launch configurations of the Triton attention kernels: the largest tiles that fit the GPU.

A tile that needs more shared memory than the SM grants one block does not launch at all, so the
choice is made per device from its opt-in shared memory per block (sm_86/sm_89 have ~99 KB,
sm_80 ~163 KB, sm_90 ~227 KB). tests/engine/attention/test_triton_aot.py compiles every kernel
for sm_80, sm_89 and sm_90 ahead of time and checks each choice against what ptxas reports.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Opt-in shared memory per block, bytes, by compute capability (CUDA programming guide table).
SHARED_MEMORY_PER_BLOCK = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}
SMALLEST_SHARED_MEMORY = min(SHARED_MEMORY_PER_BLOCK.values())
# (new tokens per extend tile, keys per step), largest first: bigger tiles reuse more of each load.
TILE_CHOICES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16))
# Shared memory the compiler adds beyond the four tiles (barriers, reduction scratch).
SHARED_SLACK_BYTES = 1024


class LaunchConfig(NamedTuple):
    block_m: int  # new tokens per extend tile
    block_n: int  # keys per inner-loop step
    block_h: int  # query heads per decode program (one kv head's group, padded for tl.dot)
    block_d: int
    num_warps: int
    num_stages: int


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def shared_bytes(block_m: int, block_n: int, block_d: int, itemsize: int) -> int:
    """Shared memory of one program: the query, key and value tiles and the probabilities."""
    return (block_m * block_d + 2 * block_n * block_d + block_m * block_n) * itemsize + \
        SHARED_SLACK_BYTES


def gpu_launch_config(dtype: torch.dtype, head_dim: int, group: int,
                      max_shared: int) -> LaunchConfig:
    """The largest tiles whose shared memory fits `max_shared` bytes per block."""
    block_h = max(16, next_power_of_2(group))  # tl.dot needs M >= 16 on GPUs
    block_d = max(16, next_power_of_2(head_dim))
    for block_m, block_n in TILE_CHOICES:
        if shared_bytes(max(block_m, block_h), block_n, block_d, dtype.itemsize) <= max_shared:
            return LaunchConfig(block_m, block_n, block_h, block_d, num_warps=4, num_stages=2)
    raise ValueError(f"no Triton attention tile fits {max_shared} bytes of shared memory at "
                     f"head_dim {head_dim}, {dtype}; use attention_backend='torch'")


def interpreter_launch_config(head_dim: int, group: int) -> LaunchConfig:
    """Small tiles so that short test rows span several of them."""
    block_h = max(16, next_power_of_2(group))
    return LaunchConfig(16, 16, block_h, max(16, next_power_of_2(head_dim)), num_warps=4,
                        num_stages=1)


def device_shared_memory(device: torch.device) -> int:
    """The opt-in shared memory per block of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    if optin:
        return int(optin)
    return SHARED_MEMORY_PER_BLOCK.get(props.major * 10 + props.minor, SMALLEST_SHARED_MEMORY)
