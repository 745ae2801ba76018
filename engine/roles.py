"""Prefill/decode roles of the in-process Engine (docs/fleet.md#prefill-and-decode): a prefill
engine's `prefill`, a decode engine's `generate_from_handoff`, the KV transfer group, and the
role checks. The KV, its descriptor and its transports are engine/kvcache/handoff.py's; the
scheduler imports and exports pages on its thread."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from hotswap.engine.client.protocol import KV_TRANSPORTS, HandoffClient
from hotswap.engine.client.request import GenerateRequest
from hotswap.engine.core.request import FinishReason, Req, VersionSpan
from hotswap.engine.kvcache.handoff import (
    HandoffRefused,
    Incoming,
    KVHandoff,
    KVOutbox,
    ShmFiles,
    group_source,
    handoff_tag,
    read_shm,
    unpack,
)
from hotswap.weight_sync.group import (
    WeightGroup,
    WeightSyncError,
    destroy_group,
    init_process_group,
)


class PrefillDecodeRoles(HandoffClient):
    """Mixed into Engine, which provides config, model_config, runner, requests and _run."""

    def _init_roles(self) -> None:
        self._shm = ShmFiles()  # "shm" handoffs this engine wrote (removed at shutdown)
        self._outbox = KVOutbox()  # "group" handoffs waiting for send_kv_handoff
        self._kv_group: WeightGroup | None = None

    def _close_roles(self) -> None:
        self._shm.cleanup()
        self.destroy_kv_transfer_group()

    def _prefill(self, request: GenerateRequest, transport: str) -> dict:
        """Compute one prompt's KV and sample its first token; the output (one sample, n=1)
        carries meta_info["kv_handoff"], the descriptor a decode engine's
        generate_from_handoff takes, and finish_reason {"type": "handoff"} unless the first
        token already ends the request. transport: "inline" (engines of one process; "auto"),
        "shm" (processes of one host) or "group" (the KV transfer group,
        init_kv_transfer_group)."""
        self._check_role("prefill", "decode")
        transport = "inline" if transport == "auto" else transport
        if transport not in KV_TRANSPORTS:
            raise ValueError(f"transport must be one of {KV_TRANSPORTS}, got {transport!r}")
        if transport == "group" and self._kv_group is None:
            raise ValueError('transport="group" needs init_kv_transfer_group first')
        reqs, _ = self.requests.build(request)
        if len(reqs) != 1:
            raise ValueError("prefill takes one prompt with n=1 (a decode engine samples the "
                             "others from the handed-off KV: generate_from_handoff)")
        reqs[0].export_kv = True
        out = self._run(reqs, True, False)
        exported = out["meta_info"].pop("kv_export", None)
        if exported is not None:
            start = time.perf_counter()
            handoff = exported.handoff()
            if transport == "shm":
                handoff = self._shm.write(handoff)
            elif transport == "group":
                handoff = self._outbox.put(handoff, self._kv_group.name, self._kv_group.rank)
            handoff.timings["publish_s"] = time.perf_counter() - start
            out["meta_info"]["kv_handoff"] = handoff.to_dict()
        return out

    def _generate_from_handoff(self, handoff: dict, request: GenerateRequest
                               ) -> dict | list[dict] | Iterator[dict]:
        """Continue a prefill engine's output (`handoff`, what Engine.prefill returned) with
        the same arguments: sample 0 goes on from the prefill's first token, samples 1..n-1
        start from the prompt. The KV is used only if it was computed under the namespace this
        engine serves for the request and arrives whole; else the prompt is computed here
        (meta_info["kv_handoff"] says which, and why). With stream=True the first token, which
        the prefill output holds, is not sent again."""
        self._check_role("generate_from_handoff", "prefill")
        first, desc = _handoff_parts(handoff)
        reqs, single = self.requests.build(request.replace(input_ids=desc.token_ids))
        try:
            _continue_from(reqs[0], first, self.model_config.vocab_size)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"handoff: not a prefill output this engine can continue "
                             f"({type(exc).__name__}: {exc})") from None
        for req in reqs:
            req.group_leader = None  # the first tokens do not come from one shared row here
        reqs[0].handoff = self._receive(desc)
        return self._run(reqs, single, request.stream)

    def _receive(self, desc: KVHandoff) -> Incoming:
        """The handoff's KV, or why there is none (the bytes did not arrive whole); read and
        checked here, in the caller's thread, never in the scheduler's."""
        start = time.perf_counter()
        try:
            if desc.transport == "inline":
                payload = desc.payload
            elif desc.transport == "shm":
                payload = read_shm(desc)
            else:
                payload = self._receive_from_group(desc)
            kv, routes = unpack(desc, payload)
        except (HandoffRefused, WeightSyncError) as exc:
            return Incoming(desc, None, None, time.perf_counter() - start, str(exc))
        return Incoming(desc, kv, routes, time.perf_counter() - start)

    def _receive_from_group(self, desc: KVHandoff) -> Any:
        name, src = group_source(desc)
        group = self._kv_group
        if group is None or group.name != name:
            raise HandoffRefused(f"this engine is not in the KV transfer group {name!r}")
        payload = torch.empty(desc.nbytes, dtype=torch.uint8)
        group.recv(payload, src, handoff_tag(desc.id))
        return payload

    def init_kv_transfer_group(self, master_address: str, master_port: int, rank: int,
                               world_size: int, group_name: str = "kv_transfer",
                               backend: str = "auto") -> dict:
        """Join the process group KV handoffs of transport "group" travel over (gloo on CPU,
        NCCL on GPU): every prefill and decode engine of a fleet, one rank each."""
        if self._kv_group is not None:
            raise ValueError(f"already in KV transfer group {self._kv_group.name!r}; destroy "
                             "it first")
        self._kv_group = init_process_group(master_address, master_port, rank, world_size,
                                            group_name, backend, device=self.runner.device)
        return {"success": True, "message": f"joined {group_name!r} as rank {rank}"}

    def send_kv_handoff(self, handoff_id: str, dst_rank: int) -> dict:
        """Send a "group" handoff's payload (kept since prefill) to the decode engine at
        `dst_rank`, which receives it in its generate_from_handoff."""
        if self._kv_group is None:
            raise ValueError("no KV transfer group (init_kv_transfer_group)")
        payload = self._outbox.take(handoff_id)
        self._kv_group.send(payload, dst_rank, handoff_tag(handoff_id))
        return {"success": True, "message": f"sent {payload.numel()} bytes to rank {dst_rank}"}

    def drop_kv_handoff(self, handoff_id: str) -> bool:
        """Forget a handoff no decode engine will take (its "group" payload, its "shm"
        file); False when none is held."""
        return self._outbox.drop(handoff_id) or self._shm.drop(handoff_id)

    def destroy_kv_transfer_group(self) -> dict:
        group, self._kv_group = self._kv_group, None
        if group is not None:
            destroy_group(group.name, group.rank)
        return {"success": group is not None, "message": "destroyed" if group else "no group"}

    def _check_role(self, call: str, refused_role: str) -> None:
        if self.config.role == refused_role:
            raise ValueError(f"{call}: this engine serves role={refused_role!r} "
                             "(docs/fleet.md#prefill-and-decode)")


def _handoff_parts(handoff: Any) -> tuple[dict, KVHandoff]:
    """A prefill output's first sample and its KV descriptor, checked."""
    meta = handoff.get("meta_info") if isinstance(handoff, dict) else None
    if not isinstance(meta, dict) or "kv_handoff" not in meta:
        raise ValueError("handoff must be an output of Engine.prefill holding "
                         "meta_info['kv_handoff']")
    ids = handoff.get("output_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise ValueError("handoff['output_ids'] must hold the prefill's first token")
    return handoff, KVHandoff.from_dict(meta["kv_handoff"])


def _continue_from(req: Req, first: dict, vocab_size: int) -> None:
    """Give `req` the tokens a prefill engine sampled (with their logprobs, versions and
    routing), as if it had sampled them itself."""
    meta = first["meta_info"]
    if not all(0 <= t < vocab_size for t in first["output_ids"]):
        raise ValueError(f"output_ids must be in [0, {vocab_size})")
    req.output_ids = list(first["output_ids"])
    if req.return_logprob:
        if "output_token_logprobs" not in meta:
            raise ValueError("return_logprob: the prefill ran without it")
        req.output_logprobs = [float(lp) for lp, _ in meta["output_token_logprobs"]]
    if req.top_logprobs_num:
        req.output_top_logprobs = [t[: req.top_logprobs_num]
                                   for t in meta.get("output_top_logprobs", [])]
    req.version_spans = [VersionSpan(s["version"], s["start"], s["end"],
                                     s.get("adapter_version"))
                         for s in meta.get("weight_versions", [])]
    routes = meta.get("routed_experts")
    if req.return_routed_experts and routes is not None:
        req.routed_experts = torch.as_tensor(np.asarray(routes))
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") not in (None, "handoff"):
        req.finish_reason = FinishReason(reason["type"], reason.get("matched"),
                                         reason.get("message"))
    else:  # a stream's first event carried the first token; the rest follows from here
        req.streamed_ids = len(req.output_ids)
