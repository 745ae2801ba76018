"""Reads HF safetensors checkpoints (single file or sharded index) into a model by HF names.

Everything is validated (names, shapes, dtypes, finite values) before any parameter is written,
so a bad checkpoint fails with a message naming the tensor and leaves the model untouched.
`write_weights` is the one place tensors are copied into the model, at load and on every update
path, so names HF's loader ignores are ignored the same way everywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from hotswap.engine.models.llama import WeightSlot

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool}
# Buffers older checkpoints carry that the runtime recomputes; transformers' loader drops the
# same pattern (PreTrainedModel._adjust_missing_and_unexpected_keys).
_IGNORED = re.compile(r"rotary_emb\.inv_freq")


def is_ignored(name: str) -> bool:
    """A name updates and checkpoints may carry that is not a weight: accepted, never written."""
    return _IGNORED.search(name) is not None


INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_path: str) -> list[str]:
    """The safetensors files of a checkpoint folder; a bad index or a missing shard is a
    ValueError naming the file (bad input, as docs/api.md says of corrupt files)."""
    index = os.path.join(model_path, INDEX_FILE)
    if os.path.isfile(index):
        return [os.path.join(model_path, s) for s in sorted(set(_index_map(index).values()))]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"no model.safetensors or {INDEX_FILE} in {model_path!r}")


def _index_map(index: str) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file), every shard checked to exist."""
    try:
        with open(index, encoding="utf-8") as f:
            data: Any = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{index}: not a readable JSON file ({exc})") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: no 'weight_map' object naming the shard of each tensor")
    folder = os.path.dirname(index)
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise ValueError(f"{index}: the shard of tensor {name!r} is {shard!r}, not a file name")
    for shard in sorted(set(weight_map.values())):
        if not os.path.isfile(os.path.join(folder, shard)):
            raise ValueError(f"{index}: shard {shard!r} is missing from {folder!r}")
    return weight_map


@contextlib.contextmanager
def open_safetensors(path: str) -> Iterator[Any]:
    """safe_open, with a corrupt or unreadable file reported as a ValueError naming it."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: not a valid safetensors file ({exc})") from exc


def read_checkpoint_meta(model_path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor, without reading the data."""
    meta = {}
    for path in checkpoint_files(model_path):
        with open_safetensors(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = f.get_slice(name)
                meta[name] = (tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype()))
    index = os.path.join(model_path, INDEX_FILE)
    if os.path.isfile(index):
        absent = sorted(set(_index_map(index)) - set(meta))
        if absent:
            raise ValueError(f"{index}: names {len(absent)} tensor(s) no shard holds, "
                             f"e.g. {absent[0]!r}")
    return meta


def iter_checkpoint(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_path):
        with open_safetensors(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def check_weights(weight_map: Mapping[str, WeightSlot],
                  meta: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
                  required: Iterable[str] = ()) -> None:
    """Raise ValueError naming every unknown, missing, misshapen or non-float tensor."""
    problems = []
    for name, (shape, dtype) in meta.items():
        if is_ignored(name):
            continue
        slot = weight_map.get(name)
        if slot is None:
            problems.append(f"unexpected tensor '{name}' (not a parameter of this model)")
        elif tuple(shape) != tuple(slot.view.shape):
            problems.append(f"tensor '{name}' has shape {tuple(shape)}, "
                            f"expected {tuple(slot.view.shape)}")
        elif dtype not in FLOAT_DTYPES:
            problems.append(f"tensor '{name}' has dtype {dtype}, expected a floating dtype "
                            f"({', '.join(str(d) for d in FLOAT_DTYPES)})")
    missing = sorted(set(required) - covered_names(weight_map, meta))
    if missing:
        shown = ", ".join(f"'{n}'" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        problems.append(f"missing tensor(s) {shown}{more}")
    if problems:
        raise ValueError("; ".join(problems))


def covered_names(weight_map: Mapping[str, WeightSlot], names: Iterable[str]) -> set[str]:
    """The names whose storage `names` write: each name itself, an alias what it covers (an MoE
    model's stacked experts, models/moe.py)."""
    out: set[str] = set()
    for name in names:
        out.update(getattr(weight_map.get(name), "covers", ()) or (name,))
    return out


def check_finite(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise ValueError naming every tensor that holds a NaN or an infinity (or no data)."""
    bad = []
    for name, tensor in named:
        if is_ignored(name):
            continue
        if tensor.is_meta:
            raise ValueError(f"tensor '{name}' holds no data (a meta tensor)")
        if not is_finite(tensor):
            bad.append(name)
    if bad:
        shown = ", ".join(f"'{n}'" for n in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(f"tensor(s) {shown}{more} hold non-finite values (NaN or inf)")


def is_finite(tensor: torch.Tensor) -> bool:
    # NaN and inf survive a sum, so a finite sum proves every element finite in one pass with
    # no temporary; only a non-finite sum (or an overflow of huge values) needs the exact test.
    if torch.isfinite(tensor.sum()):
        return True
    return bool(torch.isfinite(tensor).all())


def write_weights(weight_map: Mapping[str, WeightSlot],
                  named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy validated tensors into place by HF name; ignored names are skipped."""
    with torch.no_grad():
        for name, tensor in named:
            if not is_ignored(name):
                weight_map[name].view.copy_(tensor)


def load_checkpoint(model: torch.nn.Module, model_path: str) -> None:
    """Validate the checkpoint against the model, then copy every tensor into place."""
    weight_map = model.hf_weight_map()
    check_weights(weight_map, read_checkpoint_meta(model_path), model.required_weight_names())
    write_weights(weight_map, iter_checkpoint(model_path))
