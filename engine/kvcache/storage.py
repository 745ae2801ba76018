"""KV storage tier: prefix KV in files under a directory that engine processes share (HiCache).

A prefix is stored in blocks of `block_tokens` tokens. Block k of a token sequence holds the
KV of tokens [k*B, (k+1)*B) and is keyed by a chained hash: h_0 = sha256(namespace key),
h_{k+1} = sha256(h_k + block k's tokens), so a block's key names the whole prefix it ends, and
its KV (which depends on every earlier token) is only ever found for that prefix.

Layout: <root>/<sha256(namespace key)[:32]>/<h_{k+1}>.safetensors holding the block's KV
([2 * layers, B, kv_heads, head_dim]) and tokens, with the namespace key and prefix hash in the
metadata. Writes go to a temp file in the same folder and are renamed into place (atomic on
POSIX), so a reader in another process sees a whole file or none. A read checks the namespace
key, the prefix hash and the tokens before it hands KV back: a stale or foreign page is a miss.
Retiring a namespace renames its folder away and deletes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import uuid
from array import array
from collections.abc import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)


class KVStorage:
    def __init__(self, root: str, block_tokens: int):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.root = os.path.abspath(root)
        self.block_tokens = block_tokens
        os.makedirs(self.root, exist_ok=True)

    def block_hashes(self, ns_key: str, tokens: list[int]) -> list[str]:
        """The key of every whole block of `tokens`, in order."""
        digest = hashlib.sha256(ns_key.encode()).digest()
        out = []
        B = self.block_tokens
        for start in range(0, len(tokens) - B + 1, B):
            digest = hashlib.sha256(digest + array("q", tokens[start: start + B]).tobytes()
                                    ).digest()
            out.append(digest.hex())
        return out

    def _dir(self, ns_key: str) -> str:
        return os.path.join(self.root, hashlib.sha256(ns_key.encode()).hexdigest()[:32])

    def _path(self, ns_key: str, block_hash: str) -> str:
        return os.path.join(self._dir(ns_key), f"{block_hash}.safetensors")

    def contains(self, ns_key: str, block_hash: str) -> bool:
        return os.path.exists(self._path(ns_key, block_hash))

    def save(self, ns_key: str, block_hash: str, tokens: list[int], kv: torch.Tensor) -> bool:
        """Write one block atomically; False (logged) when the file system refuses."""
        path = self._path(ns_key, block_hash)
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_file({"kv": kv.contiguous(), "tokens": torch.tensor(tokens, dtype=torch.int64)},
                      tmp, metadata={"namespace": ns_key, "prefix_hash": block_hash})
            os.replace(tmp, path)
            return True
        except OSError as exc:  # a full disk or a folder retired meanwhile: just not stored
            logger.warning("hicache storage: could not write %s: %s", path, exc)
            with contextlib.suppress(OSError):
                os.remove(tmp)
            return False

    def load(self, ns_key: str, block_hash: str, tokens: list[int]) -> torch.Tensor | None:
        """The block's KV, or None when it is absent, unreadable or not what was asked for."""
        path = self._path(ns_key, block_hash)
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("namespace") != ns_key or meta.get("prefix_hash") != block_hash:
                    return None
                if f.get_tensor("tokens").tolist() != list(tokens):
                    return None
                return f.get_tensor("kv")
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - a damaged file is a miss, never an error
            logger.warning("hicache storage: unreadable %s: %s", path, exc)
            return None

    def retire(self, ns_key: str) -> None:
        """Delete every block of a namespace (other processes then miss, never read stale)."""
        folder = self._dir(ns_key)
        doomed = f"{folder}.retired.{uuid.uuid4().hex}"
        try:
            os.replace(folder, doomed)
        except OSError:
            return
        shutil.rmtree(doomed, ignore_errors=True)


def weights_fingerprint(tensors: Iterable[torch.Tensor], samples_per_tensor: int = 4096) -> str:
    """A short hash of evenly spaced values of every tensor: two engines serving the same
    weights agree on it, and any training step (which moves nearly every value) changes it.
    Cheap: about a million values for a 135M model, not the whole checkpoint."""
    h = hashlib.sha256()
    with torch.no_grad():
        for t in tensors:
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // samples_per_tensor)
            h.update(str(tuple(t.shape)).encode())
            h.update(flat[::step].float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]
