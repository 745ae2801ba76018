"""Attention backends, chosen by name; each is imported only when asked for."""

from __future__ import annotations

import importlib

from hotswap.engine.attention.base import AttentionBackend
from hotswap.engine.config import ATTENTION_BACKENDS

# The class of each name in config.ATTENTION_BACKENDS, the one list of names. It sits in config
# so that EngineConfig.resolve can check a name: config may not import this folder
# (docs/design.md#import-direction).
_REGISTRY = {
    "torch": "hotswap.engine.attention.torch_backend:TorchAttnBackend",
    "triton": "hotswap.engine.attention.triton_backend:TritonAttnBackend",
    "flashinfer": "hotswap.engine.attention.flashinfer_backend:FlashInferAttnBackend",
}
if _REGISTRY.keys() != set(ATTENTION_BACKENDS):
    raise ImportError(f"attention backends named in config {ATTENTION_BACKENDS} but registered "
                      f"here {tuple(_REGISTRY)}: add or drop both together")


def get_backend_class(name: str) -> type[AttentionBackend]:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose from {ATTENTION_BACKENDS}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["AttentionBackend", "get_backend_class"]
