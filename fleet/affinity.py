"""Which server last saw which prompt prefix: an approximate radix tree for the Router, and the
key a request is routed by.

Keys are the request's prompt as the client sent it: text (characters), token ids, or chat
messages in canonical JSON, after its images' digests where it has some; a long common prefix
of keys means a long common prefix of tokens, so the server that served a key holds its
prefix's KV (until that server evicts it, which the router cannot see: the tree is a hint,
never a promise). Memory is bounded: past `max_items` key elements the least recently routed
keys are forgotten.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Key = Sequence  # a str or a tuple of ints


@dataclass
class _Node:
    edge: Key = ()
    children: dict = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)  # server -> keys through this node


class PrefixAffinity:
    def __init__(self, max_items: int = 1 << 20):
        self.max_items = max_items
        self._root = _Node()
        self._recent: OrderedDict[tuple[Key, int], None] = OrderedDict()
        self._items = 0

    def match(self, key: Key) -> dict[int, int]:
        """server -> length of the longest prefix of `key` that server has served."""
        best: dict[int, int] = {}
        node, depth = self._root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                break
            common = _common(child.edge, key, depth)
            depth += common
            for server in child.counts:
                best[server] = depth
            if common < len(child.edge):
                break
            node = child
        return best

    def insert(self, key: Key, server: int) -> None:
        if not key:
            return
        entry = (key, server)
        if entry in self._recent:
            self._recent.move_to_end(entry)
            return
        self._recent[entry] = None
        self._items += len(key)
        self._walk(key, server, +1)
        while self._items > self.max_items and len(self._recent) > 1:
            old, old_server = self._recent.popitem(last=False)[0]
            self._items -= len(old)
            self._walk(old, old_server, -1)

    def forget_server(self, server: int) -> None:
        """Drops everything `server` served (it restarted or flushed its cache)."""
        for entry in [e for e in self._recent if e[1] == server]:
            del self._recent[entry]
            self._items -= len(entry[0])
            self._walk(entry[0], server, -1)

    def _walk(self, key: Key, server: int, delta: int) -> None:
        """Adds (delta=1, creating nodes) or removes (delta=-1, pruning nodes) one key."""
        node, depth = self._root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                child = node.children[key[depth]] = _Node(edge=key[depth:])
            common = _common(child.edge, key, depth)
            if common < len(child.edge):
                child = self._split(node, child, common)
            count = child.counts.get(server, 0) + delta
            if count > 0:
                child.counts[server] = count
            else:
                child.counts.pop(server, None)
            if not child.counts:
                del node.children[key[depth]]
                return
            depth += common
            node = child

    @staticmethod
    def _split(parent: _Node, child: _Node, at: int) -> _Node:
        head = _Node(edge=child.edge[:at], counts=dict(child.counts))
        child.edge = child.edge[at:]
        head.children[child.edge[0]] = child
        parent.children[head.edge[0]] = head
        return head


def _common(edge: Key, key: Key, start: int) -> int:
    n = min(len(edge), len(key) - start)
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i


def affinity_key(path: str, body: dict[str, Any]) -> Key:
    """The first prompt of a request, as the tree compares it: text, token ids, or messages as
    canonical JSON (equal conversation prefixes give equal JSON prefixes)."""
    if path == "/v1/chat/completions" or body.get("messages") is not None:
        messages = body.get("messages") or []
        if messages and isinstance(messages[0], list):
            messages = messages[0]
        return _canonical(messages)[:-1]  # without "]", so a longer conversation extends it
    prompt = body.get("input_ids")
    for name in ("prompt", "text", "input", "query"):  # "input": vLLM's; "query": OpenRLHF's
        if prompt is None:
            prompt = body.get(name)
    images = body.get("image_data")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
        images = images[0] if isinstance(images, list) and images else None
    images = [] if images is None else images if isinstance(images, list) else [images]
    # A prompt's images lead its key: requests with other images share no KV past the first
    # image (the engine keys image tokens by content), those with the same images do.
    if isinstance(prompt, str):
        return "".join(f"\0{_digest(image)}\0" for image in images) + prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return tuple(-1 - int(_digest(image)[:15], 16) for image in images) + tuple(prompt)
    return ""


def _digest(image: Any) -> str:
    """A cheap identity of an image as sent (the same encoding of a picture gives the same)."""
    if isinstance(image, str):
        data = image.encode()
    elif isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    elif hasattr(image, "tobytes"):  # a PIL image
        data = f"{image.mode}{image.size}".encode() + image.tobytes()
    else:
        data = repr(image).encode()
    return hashlib.sha256(data).hexdigest()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
