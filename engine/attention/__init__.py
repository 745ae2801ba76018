"""Attention backends, chosen by name; each is imported only when asked for."""

from __future__ import annotations

import importlib

from hotswap.engine.attention.base import AttentionBackend

_REGISTRY = {
    "torch": "hotswap.engine.attention.torch_backend:TorchAttnBackend",
    "triton": "hotswap.engine.attention.triton_backend:TritonAttnBackend",
    "flashinfer": "hotswap.engine.attention.flashinfer_backend:FlashInferAttnBackend",
}


def get_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention_backend {name!r}; choose from {sorted(_REGISTRY)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["AttentionBackend", "get_backend_class"]
