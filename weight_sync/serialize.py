"""Named tensors as text, for `/update_weights_from_tensor` over HTTP (one call per bucket).

SGLang's trainers send `MultiprocessingSerializer` output there: a pickle of CUDA IPC handles,
which only a process on the same GPU can open and which runs code when unpickled. hotswap takes
safetensors bytes instead (base64 in the JSON body): no code runs on load, and the bytes carry
the values, so the trainer may be on another host. `flattened_bucket` (slime, verl) travels as
the bucket's tensors by name: the same wire format, unpacked on the trainer side.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def serialize_named_tensors(named_tensors: NamedTensors) -> str:
    """base64 safetensors of the tensors (copied off any device; shared storage is split)."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        if name in tensors:
            raise ValueError(f"tensor name {name!r} repeats")
        tensors[name] = tensor.detach().to("cpu").contiguous().clone()
    return base64.b64encode(st_save(tensors)).decode("ascii")


def deserialize_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of serialize_named_tensors' output; ValueError when it is not."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError) as err:
        raise ValueError(f"serialized_named_tensors: not base64 ({err})") from err
    try:
        return list(st_load(raw).items())
    except (SafetensorError, ValueError, RuntimeError) as err:
        raise ValueError("serialized_named_tensors: expected base64 safetensors bytes "
                         "(hotswap.weight_sync.serialize_named_tensors); pickled tensors "
                         f"(SGLang's MultiprocessingSerializer) are refused ({err})") from err
