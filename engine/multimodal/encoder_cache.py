"""EncoderCache: the vision encoder's outputs, kept per (namespace, image) within a budget.

A step's image tokens (ScheduleBatch.image_spans) need their images' features: those cached
under the request's namespace (weights version and epoch, adapter and its version, cache
salt) are taken, the rest encoded in one call of the tower and kept, least recently used
dropped first past `budget_bytes`. A GRPO group's n samples share their leader's prefill, and a
prompt chunked over several steps encodes its images once. Entries retire with their namespace
(`retire_where`, called beside the radix tree's on every weight change): features computed by
old weights are never served, like KV (DESIGN invariant 1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from hotswap.engine.core.forward_batch import VisionInputs
from hotswap.engine.core.namespace import Namespace
from hotswap.engine.models.qwen_vl import chunk_vision_inputs, join_vision_inputs, split_features
from hotswap.engine.models.vision import VisionFeatures

Key = tuple[Namespace, str]  # (the request's namespace, the image's content hash)


def _nbytes(features: VisionFeatures) -> int:
    deep = features.deepstack
    return features.embeds.nbytes + (0 if deep is None else deep.nbytes)


class EncoderCache:
    def __init__(self, encode: Callable[[torch.Tensor, list[tuple[int, int, int]]],
                                        VisionFeatures],
                 merge_size: int, budget_bytes: int, stats: dict[str, Any]):
        self.encode = encode  # the model's encode_images
        self.merge_size = merge_size
        self.budget_bytes = budget_bytes
        self.stats = stats  # the scheduler's: encoder_runs (images encoded), encoder_hits
        self.stats.update(encoder_runs=0, encoder_hits=0)
        self._entries: OrderedDict[Key, VisionFeatures] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def vision_inputs(self, spans: list[Any]) -> VisionInputs | None:
        """The VisionInputs of a step's image spans (schedule_batch.ImageSpan: each request's
        namespace is set, it has been admitted)."""
        shown = [(s, [p for p in s.req.images.images if p.offset < s.end and s.start < p.end])
                 for s in spans]
        features = self._features([(s.req.namespace, p) for s, images in shown for p in images])
        return join_vision_inputs([chunk_vision_inputs(
            [(p.offset, features[(s.req.namespace, p.image.hash)]) for p in images],
            s.start, s.end, s.row) for s, images in shown])

    def _features(self, wanted: list[tuple[Namespace, Any]]) -> dict[Key, VisionFeatures]:
        """Each wanted (namespace, PromptImage)'s features: cached, or encoded now (the
        missing ones in one call) and cached."""
        found: dict[Key, VisionFeatures] = {}
        missing: dict[Key, Any] = {}
        for ns, placed in wanted:
            key = (ns, placed.image.hash)
            if key in found or key in missing:
                continue
            cached = self._entries.get(key)
            if cached is None:
                missing[key] = placed.image
                continue
            self._entries.move_to_end(key)
            self.stats["encoder_hits"] += 1
            found[key] = cached
        if missing:
            images = list(missing.values())
            grids = [image.grid_thw for image in images]
            encoded = self.encode(torch.cat([image.pixel_values for image in images]), grids)
            for key, features in zip(missing, split_features(encoded, grids, self.merge_size)):
                found[key] = features
                self._put(key, features)
            self.stats["encoder_runs"] += len(missing)
        return found

    def _put(self, key: Key, features: VisionFeatures) -> None:
        size = _nbytes(features)
        if size > self.budget_bytes:
            return
        # a copy: split_features' views would keep the whole step's output alive
        deep = features.deepstack
        self._entries[key] = VisionFeatures(features.embeds.clone(),
                                            None if deep is None else deep.clone())
        self.nbytes += size
        while self.nbytes > self.budget_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.nbytes -= _nbytes(dropped)

    def retire_where(self, retired: Callable[[Namespace], bool]) -> None:
        """Drop the entries of the namespaces `retired` says are gone (old weights or adapter
        versions)."""
        for key in [k for k in self._entries if retired(k[0])]:
            self.nbytes -= _nbytes(self._entries.pop(key))

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
