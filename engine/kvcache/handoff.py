"""The KV handoff between a prefill engine and a decode engine (docs/fleet.md#prefill-and-decode).

A prefill engine computes a prompt's KV and its first token, then exports the prompt's KV with
what computed it: the namespace (weight version, adapter and its version, cache salt), the token
ids, the page count, the byte count and a CRC32 of the bytes. A decode engine imports it into its
own pages and radix cache only when the namespace is the one it serves and the bytes are whole
and check out; otherwise it computes the prompt itself. Either way the request's output says what
became of the handoff (meta_info["kv_handoff"]).

The payload is one uint8 tensor: the KV, [2 * layers, tokens, kv_heads, head_dim] in the KV
pool's dtype (K of every layer, then V), then, when the engine keeps MoE routing, the routes,
[tokens, moe_layers, top_k] int16. It travels:
- "inline": the tensor itself, between engines of one process;
- "shm": a file in /dev/shm (the temporary folder where there is none), between processes of one
  host; the reader removes it, the writer removes what is left at shutdown;
- "group": a torch.distributed process group (gloo on CPU, NCCL on GPU; weight_sync's group
  code): the prefill engine keeps the payload until the front asks it to send it to the decode
  engine's rank (`KVOutbox`), which receives it into a host buffer.
Nothing is written into a decode engine's pages before the whole payload is in hand and checked:
a transfer that never completes reserves no pages.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import torch

from hotswap.engine.client.protocol import KV_TRANSPORTS
from hotswap.engine.core.namespace import Namespace

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHM_PREFIX = "hotswap-kv-"


class HandoffRefused(Exception):
    """A handoff that cannot be used; the message says why (the request recomputes its KV)."""


@dataclass
class KVHandoff:
    """What a prefill engine hands over: the descriptor travels as JSON, the payload by its
    transport (`payload` is set only for "inline")."""

    id: str
    weight_version: str
    adapter_name: str | None
    adapter_version: int
    cache_salt: str | None
    token_ids: list[int]
    page_size: int
    num_pages: int
    dtype: str
    kv_shape: list[int]  # [2 * layers, tokens, kv_heads, head_dim]
    routes_shape: list[int] | None
    nbytes: int
    checksum: int  # CRC32 of the payload's bytes
    transport: str = "inline"
    location: str | None = None  # shm: the file; group: "<group name>:<source rank>"
    # seconds the prefill engine spent: reading the KV out of its pool ("export_s", on its
    # scheduler thread), checksumming and handing it to the transport ("publish_s")
    timings: dict[str, float] = field(default_factory=dict)
    payload: torch.Tensor | None = field(default=None, repr=False)
    # the content hashes of the prompt's images, in order (a vision-language prompt's KV is
    # taken only for the same images)
    image_hashes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(replace(self, payload=None))
        del out["payload"]
        if self.payload is not None:
            out["payload"] = self.payload
        return out

    @classmethod
    def from_dict(cls, obj: Any) -> KVHandoff:
        if not isinstance(obj, dict):
            raise ValueError("kv_handoff must be the descriptor a prefill engine returned "
                             "(meta_info['kv_handoff'])")
        names = set(cls.__dataclass_fields__)
        missing = sorted(names - {"payload", "location", "transport", "timings",
                                  "image_hashes"} - set(obj))
        unknown = sorted(set(obj) - names)
        if missing or unknown:
            raise ValueError(f"kv_handoff: missing fields {missing}, unknown fields {unknown}")
        handoff = cls(**obj)
        handoff._check()
        return handoff

    def _check(self) -> None:
        def ints(value: Any, count: int | None = None) -> bool:
            return (isinstance(value, list) and bool(value) and (count in (None, len(value)))
                    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                            for v in value))

        kinds = {"id": str, "weight_version": str, "adapter_version": int, "page_size": int,
                 "num_pages": int, "nbytes": int, "checksum": int, "timings": dict}
        wrong = [name for name, kind in kinds.items()
                 if not isinstance(getattr(self, name), kind)
                 or isinstance(getattr(self, name), bool)]
        wrong += [name for name in ("adapter_name", "cache_salt", "location")
                  if getattr(self, name) is not None and not isinstance(getattr(self, name), str)]
        if not (isinstance(self.image_hashes, list)
                and all(isinstance(h, str) for h in self.image_hashes)):
            wrong.append("image_hashes")
        if wrong:
            raise ValueError(f"kv_handoff: fields of the wrong type: {wrong}")
        if not ints(self.token_ids):
            raise ValueError("kv_handoff.token_ids must be a non-empty list of ints")
        if self.transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_handoff.transport must be one of {KV_TRANSPORTS}, got "
                             f"{self.transport!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"kv_handoff.dtype must be one of {sorted(_DTYPES)}")
        shape = self.kv_shape
        if not ints(shape, 4) or shape[1] != len(self.token_ids):
            raise ValueError("kv_handoff.kv_shape must be [2 * layers, tokens, kv_heads, "
                             "head_dim] with one row per token id")
        routes = self.routes_shape
        if routes is not None and (not ints(routes, 3) or routes[0] != shape[1]):
            raise ValueError("kv_handoff.routes_shape must be [tokens, moe_layers, top_k]")
        size = int(np.prod(shape)) * _DTYPES[self.dtype].itemsize
        size += 0 if routes is None else int(np.prod(routes)) * 2
        if self.nbytes != size:
            raise ValueError(f"kv_handoff.nbytes {self.nbytes} is not what its shapes hold "
                             f"({size})")
        if self.transport == "inline" and not isinstance(self.payload, torch.Tensor):
            raise ValueError("kv_handoff: an inline handoff carries its payload tensor")
        if self.transport != "inline" and not isinstance(self.location, str):
            raise ValueError(f"kv_handoff: a {self.transport} handoff names its location")

    @property
    def namespace_fields(self) -> tuple[str, str | None, int, str | None]:
        return (self.weight_version, self.adapter_name, self.adapter_version, self.cache_salt)

    def image_refusal(self, image_hashes: list[str]) -> str | None:
        """Why a request whose prompt holds the images of `image_hashes` must not use this KV,
        or None."""
        if image_hashes != self.image_hashes:
            return "the prompt's images differ from those the KV was computed with"
        return None

    def refusal(self, ns: Namespace) -> str | None:
        """Why a decode engine serving `ns` for this request must not use this KV, or None."""
        served = (ns.weight_version, ns.adapter_name, ns.adapter_version, ns.cache_salt)
        if served == self.namespace_fields:
            return None
        names = ("weight_version", "adapter_name", "adapter_version", "cache_salt")
        diff = [f"{n} {a!r} (here {b!r})" for n, a, b in zip(names, self.namespace_fields,
                                                             served) if a != b]
        return "namespace differs: " + ", ".join(diff)


class Incoming(NamedTuple):
    """A handoff as a decode engine received it: the KV and routes, or why there are none."""

    handoff: KVHandoff
    kv: torch.Tensor | None
    routes: torch.Tensor | None
    receive_s: float  # reading and checking the bytes
    error: str | None = None


@dataclass
class Exported:
    """A prompt's KV read out of a prefill engine's pool (on its scheduler thread)."""

    namespace: Namespace
    token_ids: list[int]
    page_size: int
    kv: torch.Tensor  # [2 * layers, tokens, kv_heads, head_dim], CPU
    routes: torch.Tensor | None  # [tokens, moe_layers, top_k] int16, CPU
    export_s: float  # reading them out, on the scheduler thread
    image_hashes: list[str] = field(default_factory=list)

    def handoff(self) -> KVHandoff:
        """The descriptor and its payload (checksummed here, off the scheduler thread)."""
        parts = [self.kv.reshape(-1).view(torch.uint8)]
        if self.routes is not None:
            parts.append(self.routes.reshape(-1).view(torch.uint8))
        payload = torch.cat(parts) if len(parts) > 1 else parts[0]
        ns = self.namespace
        n = len(self.token_ids)
        return KVHandoff(
            id=uuid.uuid4().hex, weight_version=ns.weight_version, adapter_name=ns.adapter_name,
            adapter_version=ns.adapter_version, cache_salt=ns.cache_salt,
            token_ids=list(self.token_ids), page_size=self.page_size,
            num_pages=-(-n // self.page_size), dtype=str(self.kv.dtype).removeprefix("torch."),
            kv_shape=list(self.kv.shape),
            routes_shape=None if self.routes is None else list(self.routes.shape),
            nbytes=payload.numel(), checksum=checksum(payload),
            timings={"export_s": self.export_s}, payload=payload,
            image_hashes=list(self.image_hashes))


def checksum(payload: torch.Tensor) -> int:
    return zlib.crc32(payload.numpy())


def unpack(handoff: KVHandoff, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The payload's KV and routes, after checking its size and checksum (HandoffRefused)."""
    if payload.numel() != handoff.nbytes:
        raise HandoffRefused(f"truncated transfer: {payload.numel()} of {handoff.nbytes} bytes")
    if checksum(payload) != handoff.checksum:
        raise HandoffRefused("checksum mismatch: the KV bytes changed in transit")
    dtype = _DTYPES[handoff.dtype]
    kv_bytes = int(np.prod(handoff.kv_shape)) * dtype.itemsize
    kv = payload[:kv_bytes].view(dtype).reshape(handoff.kv_shape)
    routes = None
    if handoff.routes_shape is not None:
        routes = payload[kv_bytes:].view(torch.int16).reshape(handoff.routes_shape)
    return kv, routes


# shared memory: processes of one host


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmFiles:
    """The shm files one engine wrote and nobody read yet: removed at its shutdown."""

    def __init__(self) -> None:
        self._paths: set[str] = set()
        self._lock = threading.Lock()

    def write(self, handoff: KVHandoff) -> KVHandoff:
        path = os.path.join(_shm_dir(), f"{_SHM_PREFIX}{os.getpid()}-{handoff.id}")
        tmp = path + ".part"
        with open(tmp, "wb") as f:
            f.write(memoryview(handoff.payload.numpy()))
        os.replace(tmp, path)  # a reader never sees a half-written file under the final name
        with self._lock:
            self._paths.add(path)
        return replace(handoff, transport="shm", location=path, payload=None)

    def drop(self, handoff_id: str) -> bool:
        """Remove the file of a handoff nobody will read; False when there is none."""
        with self._lock:
            path = next((p for p in self._paths if p.endswith(f"-{handoff_id}")), None)
            self._paths.discard(path)
        if path is None or not os.path.exists(path):
            return False
        discard_file(path)
        return True

    def cleanup(self) -> None:
        with self._lock:
            paths, self._paths = self._paths, set()
        for path in paths:
            discard_file(path)


def _shm_path(path: Any) -> str:
    if (not isinstance(path, str) or not os.path.basename(path).startswith(_SHM_PREFIX)
            or os.path.dirname(path) != _shm_dir()):
        raise ValueError(f"kv_handoff.location {path!r} is not a hotswap shm handoff file")
    return path


def read_shm(handoff: KVHandoff) -> torch.Tensor:
    """The payload of a shm handoff; the file is removed (read once)."""
    path = _shm_path(handoff.location)
    try:  # mapped, not read: the checksum and the copy into the pool are the only passes
        if os.path.getsize(path) == 0:
            discard_file(path)
            raise HandoffRefused("truncated transfer: 0 bytes")
        data = np.memmap(path, dtype=np.uint8, mode="c")
    except FileNotFoundError as exc:
        raise HandoffRefused(f"the shm file {path} is gone (read already, or its writer "
                             "shut down)") from exc
    discard_file(path)
    return torch.from_numpy(data)


def discard_file(path: str) -> None:
    """Remove a shm handoff file (ValueError for any other path)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_shm_path(path))


# a process group: any two hosts


class KVOutbox:
    """Payloads a prefill engine keeps for a "group" handoff until sent (or `ttl_s` passes)."""

    def __init__(self, ttl_s: float = 120.0) -> None:
        self.ttl_s = ttl_s
        self._items: dict[str, tuple[float, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def put(self, handoff: KVHandoff, group: str, rank: int) -> KVHandoff:
        now = time.monotonic()
        with self._lock:
            self._items = {k: v for k, v in self._items.items() if v[0] > now}
            self._items[handoff.id] = (now + self.ttl_s, handoff.payload)
        return replace(handoff, transport="group", location=f"{group}:{rank}", payload=None)

    def take(self, handoff_id: str) -> torch.Tensor:
        with self._lock:
            item = self._items.pop(handoff_id, None)
        if item is None:
            raise ValueError(f"kv handoff {handoff_id!r}: not held here (sent already, or "
                             "expired)")
        return item[1]

    def drop(self, handoff_id: str) -> bool:
        with self._lock:
            return self._items.pop(handoff_id, None) is not None


def handoff_tag(handoff_id: str) -> int:
    """The point-to-point tag of a handoff's transfer: both sides derive it from its id."""
    return zlib.crc32(handoff_id.encode()) & 0x7FFFFFFF


def group_source(handoff: KVHandoff) -> tuple[str, int]:
    name, _, rank = (handoff.location or "").rpartition(":")
    if not name or not rank.isdigit():
        raise ValueError(f"kv_handoff.location {handoff.location!r}: expected "
                         "'<group name>:<source rank>'")
    return name, int(rank)
