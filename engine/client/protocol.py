"""The engine interface, declared once (docs/api.md#one-interface).

`Engine` (in-process), `RemoteEngine` (one server over HTTP), `hotswap.fleet.Router` (several
servers) and `hotswap.fleet.RayFleet` implement `EngineClient` with these exact signatures; a
conformance test runs the same calls against each. The methods that take a request
(generate, classify, the distributed update) are made from its definition in request.py; an
implementation writes their `_name(request)` counterpart. Code that takes an engine
(TokenClient, the rollout loops, the adapters, WeightSender targets) takes any of them.

The rules every implementation shares live here too, each once: the pause modes, the staging
modes, the largest `n`, and how `commit=None` resolves. This module imports nothing from the
engine, so the scheduler, the weight manager and the server can all read the rules from it.
"""

from __future__ import annotations

import base64
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from inspect import Parameter
from typing import Any

import numpy as np

from hotswap.engine.client.request import (
    ClassifyRequest,
    DistributedUpdate,
    GenerateRequest,
    request_method,
)

PAUSE_MODES = ("abort", "retract", "in_place")
# Where a distributed update lands: "standby" beside the live weights (refused before any write),
# "none" in place (no extra memory; a bad tensor found after its write stops generation).
STAGING_MODES = ("standby", "none")
MAX_N = 1024  # samples per prompt; larger fan-outs belong in the rollout layer
MEMORY_TAGS = ("weights", "kv_cache")
# How a prefill engine's KV reaches a decode engine (docs/fleet.md#prefill-and-decode).
KV_TRANSPORTS = ("inline", "shm", "group")
# The server's native route for classify (its body: ClassifyRequest's fields), RemoteEngine's.
CLASSIFY_PATH = "/classify_native"


def check_pause_mode(mode: Any, what: str = "pause_mode") -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"{what} must be one of {PAUSE_MODES}, got {mode!r}")
    return mode


def check_staging(staging: Any, what: str = "staging") -> str:
    if not isinstance(staging, str) or staging not in STAGING_MODES:
        raise ValueError(f"{what} must be one of {STAGING_MODES}, got {staging!r}")
    return staging


def resolve_commit(commit: bool | None, flush_cache: bool) -> bool:
    """commit=None commits when flush_cache is true: SGLang's trainers send flush_cache=False on
    every bucket of an update but the last, so the buckets stage and the last one commits."""
    return bool(flush_cache) if commit is None else bool(commit)


def check_request_model(served: str, model: str | None) -> None:
    """A request naming a model (model=) goes to an engine serving it: ValueError otherwise."""
    if model is not None and model != served:
        raise ValueError(f"model {model!r}: this engine serves {served!r}")


def check_update_model(served: str, frozen: bool, model: str | None) -> None:
    """Whether an update addressed to `model` (None: the policy) may change an engine serving
    `served`: one naming another model is refused, and a frozen engine (a reward model, a
    judge) takes only updates that name it, so a policy's updates never reach it."""
    if model is not None and model != served:
        raise ValueError(f"the update is for model {model!r}; this engine serves {served!r}")
    if model is None and frozen:
        raise ValueError(f"this engine serves frozen model {served!r}; an update must pass "
                         f"model={served!r}")


def memory_tags(tags: list[str] | None) -> list[str]:
    if tags is None:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not tags or any(t not in MEMORY_TAGS for t in tags):
        raise ValueError(f"tags must be a non-empty list drawn from {list(MEMORY_TAGS)}")
    return tags


class EngineClient(ABC):
    """Everything a trainer or a rollout loop calls on an engine, wherever the engine runs.

    Results of control calls are dicts with "success" and "message" (and "weight_version" for
    updates); bad input raises ValueError before anything changes.
    """

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    @abstractmethod
    def model_name(self) -> str:
        """The served model's name (EngineConfig.served_model_name; a fleet's: its policy's):
        what `model=` names in requests and updates."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops an in-process engine; closes a client's connections (the servers keep running)."""

    # generation

    generate = request_method("generate", doc="""
        One output per (prompt, sample), in the order given; a dict for one prompt with n=1;
        with stream=True an iterator of incremental outputs. The arguments are GenerateRequest's
        fields (engine/client/request.py): the first three positional in SGLang's order, the
        rest keyword-only.""")
    async_generate = request_method("async_generate", asynchronous=True, doc="""
        As generate; with stream=True an async iterator of incremental outputs.""")

    @abstractmethod
    def _generate(self, request: GenerateRequest) -> dict | list[dict] | Iterator[dict]:
        """generate's work, given the request it was called with."""

    @abstractmethod
    async def _async_generate(self, request: GenerateRequest
                              ) -> dict | list[dict] | AsyncIterator[dict]:
        """async_generate's work, given the request it was called with."""

    # scoring (a reward model: docs/api.md#scoring)

    classify = request_method("classify", ClassifyRequest, doc="""
        A reward model's scores: per prompt {"scores": [num_labels floats], "meta_info"}, from
        the sequence's last token (raw values unless activation); a dict for one prompt.
        Prefill only, through the prefix cache. ValueError on a model that generates. The
        arguments are ClassifyRequest's fields (engine/client/request.py).""")
    async_classify = request_method("async_classify", ClassifyRequest, asynchronous=True,
                                    doc="""As classify.""")

    @abstractmethod
    def _classify(self, request: ClassifyRequest) -> dict | list[dict]:
        """classify's work, given the request it was called with."""

    @abstractmethod
    async def _async_classify(self, request: ClassifyRequest) -> dict | list[dict]:
        """async_classify's work."""

    @abstractmethod
    def open_session(self, ttl_s: float = 300.0, session_id: str | None = None) -> str:
        """Opens a session (one conversation) and returns its id: each turn generated with
        `session_id=` leaves its KV pinned, so the next turn prefills only its new tokens.
        Pins end with close_session, ttl_s without a turn, the pin budget, or a weight update.
        A fleet keeps a session on one replica."""

    @abstractmethod
    def close_session(self, session_id: str) -> bool:
        """Closes a session and frees its pin; False when no such session is open."""

    @abstractmethod
    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Finishes the request `rid` (or every request) with finish_reason "abort"."""

    # serving state

    @abstractmethod
    def pause_generation(self, mode: str = "retract") -> dict:
        """Holds generation; running requests are aborted, retracted or kept (PAUSE_MODES)."""

    @abstractmethod
    def continue_generation(self) -> dict:
        """Resumes generation, committing a staged weight update first."""

    @abstractmethod
    def flush_cache(self, timeout_s: float | None = None) -> dict:
        """Drops the prefix cache (committing a staged update first); never raises because
        work is in flight: waits up to timeout_s or reports."""

    @abstractmethod
    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Frees "weights" and/or "kv_cache" (None: both) while nothing runs."""

    @abstractmethod
    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Takes released memory back; released weights need a complete update to serve."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Runs the cache invariants' checks; AssertionError naming what broke."""

    # weights: versions and one-call updates

    @abstractmethod
    def get_weight_version(self) -> str:
        """The version new requests are served with."""

    @abstractmethod
    def update_weight_version(self, new_version: str, abort_all_requests: bool = False, *,
                              model: str | None = None) -> dict:
        """Relabels the serving weights (they do not change); old cache namespaces retire.
        model: as for updates (every update method takes it): the model it is for; None: the
        policy. A frozen model refuses an update that does not name it (check_update_model)."""

    @abstractmethod
    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first truncate_size values of one weight (HF name), flattened, as floats."""

    @abstractmethod
    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, *, weight_version: str | None = None,
                                   pause_mode: str = "retract", commit: bool | None = None,
                                   model: str | None = None) -> dict:
        """(HF name, tensor) pairs or a dict; a subset of the weights is fine. commit=False
        sends a piece of an update that holds generation until commit_weight_update; None:
        see resolve_commit."""

    @abstractmethod
    def update_weights_from_serialized(self, serialized_named_tensors: list[str],
                                       load_format: str | None = None, flush_cache: bool = True,
                                       *, weight_version: str | None = None,
                                       pause_mode: str = "retract",
                                       commit: bool | None = None,
                                       model: str | None = None) -> dict:
        """update_weights_from_tensor with the tensors as base64 safetensors, one string per
        sender rank (the form of the HTTP route)."""

    @abstractmethod
    def update_weights_from_disk(self, model_path: str, load_format: str | None = None, *,
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 pause_mode: str = "retract", commit: bool | None = None,
                                 model: str | None = None) -> dict:
        """Loads a checkpoint folder of the same architecture (a path the engine can read)."""

    # weights: a trainer's process group

    @property
    @abstractmethod
    def weight_sync_ranks(self) -> int:
        """Ranks this target takes in a trainer's weight-update group (one per TP rank)."""

    @abstractmethod
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "auto") -> dict:
        """Joins the trainer's group at rank_offset (a TP engine at rank_offset + tp_rank)."""

    update_weights_from_distributed = request_method(
        "update_weights_from_distributed", DistributedUpdate, doc="""
        Receives a broadcast of these tensors (load_format "flattened_bucket": one buffer per
        dtype); with lora_name they are that adapter's PEFT tensors. staging (STAGING_MODES;
        None: the engine's weight_staging) says where base weights land; "none" is refused
        where it cannot keep all-or-none (tensor parallelism, several servers). The arguments
        are DistributedUpdate's fields (engine/client/request.py).""")

    @abstractmethod
    def _update_weights_from_distributed(self, update: DistributedUpdate) -> dict:
        """update_weights_from_distributed's work."""

    @abstractmethod
    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """Leaves the group."""

    # weights: the open update transaction (docs/api.md#the-weight-update-transaction)

    prepare_weights_from_distributed = request_method(
        "prepare_weights_from_distributed", DistributedUpdate,
        drop=DistributedUpdate.COMMIT_FIELDS, doc="""
        Opens an update received and validated beside the serving weights (serving goes
        on) and proposes a version; commit_weight_update installs it.""")

    @abstractmethod
    def _prepare_weights_from_distributed(self, update: DistributedUpdate) -> dict:
        """prepare_weights_from_distributed's work (the update's commit fields unset)."""

    @abstractmethod
    def prepare_weights_from_disk(self, model_path: str, *, model: str | None = None) -> dict:
        """Opens an update from a checkpoint, read and validated while serving goes on."""

    @abstractmethod
    def commit_weight_update(self, weight_version: str | None = None,
                             pause_mode: str | None = None) -> dict:
        """Commits the open update (prepared, or pieces sent with commit=False) as one
        version; ValueError when none is open. pause_mode applies to a prepared update
        (None: "retract"); pieces paused generation with their own."""

    @abstractmethod
    def abort_weight_update(self) -> dict:
        """Drops the open update; nothing changes unless pieces were written in place, in
        which case generation is refused until a complete update succeeds."""

    # LoRA adapters

    @abstractmethod
    def load_lora_adapter(self, lora_name: str, lora_path: str, *,
                          pause_mode: str = "retract") -> dict:
        """Loads or replaces an adapter from a PEFT folder; bumps its version."""

    @abstractmethod
    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict,
                                       *, pause_mode: str = "retract") -> dict:
        """tensors: PEFT name -> tensor; config_dict: the adapter_config.json dict."""

    @abstractmethod
    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Unloads an adapter; its requests finish with "abort", its cache retires."""

    @abstractmethod
    def list_lora_adapters(self) -> dict[str, int]:
        """Loaded adapters and their versions."""


class HandoffClient(ABC):
    """The prefill/decode handoff (docs/fleet.md#prefill-and-decode), declared once: Engine and
    RemoteEngine implement it; hotswap.fleet.PDRouter calls it on each engine of a pair."""

    prefill = request_method("prefill", drop=("stream", "session_id"), trailing=(
        Parameter("transport", Parameter.KEYWORD_ONLY, default="auto", annotation="str"),),
        doc="""One prompt's KV and first token; meta_info["kv_handoff"] describes the KV.""")
    generate_from_handoff = request_method(
        "generate_from_handoff", drop=("prompt", "input_ids", "messages", "session_id"),
        leading=(Parameter("handoff", Parameter.POSITIONAL_OR_KEYWORD, annotation="dict"),),
        doc="""Decode on from a prefill output (its KV used only under the same namespace).""")

    @abstractmethod
    def _prefill(self, request: GenerateRequest, transport: str) -> dict:
        """prefill's work."""

    @abstractmethod
    def _generate_from_handoff(self, handoff: dict, request: GenerateRequest
                               ) -> dict | list[dict] | Iterator[dict]:
        """generate_from_handoff's work; the request has no prompt (the handoff's is used)."""

    @abstractmethod
    def init_kv_transfer_group(self, master_address: str, master_port: int, rank: int,
                               world_size: int, group_name: str = "kv_transfer",
                               backend: str = "auto") -> dict:
        """Join the process group that "group" handoffs travel over."""

    @abstractmethod
    def send_kv_handoff(self, handoff_id: str, dst_rank: int) -> dict:
        """Send a kept "group" handoff to the decode engine at dst_rank."""

    @abstractmethod
    def drop_kv_handoff(self, handoff_id: str) -> bool:
        """Forget a kept "group" handoff."""

    @abstractmethod
    def destroy_kv_transfer_group(self) -> dict:
        """Leave the KV transfer group."""


def routes_to_json(routes: np.ndarray) -> dict[str, Any]:
    """meta_info["routed_experts"] over HTTP: the array's little-endian bytes in base64."""
    dtype = routes.dtype.newbyteorder("<")
    return {"dtype": dtype.name, "shape": list(routes.shape),
            "data": base64.b64encode(routes.astype(dtype, copy=False).tobytes()).decode()}


def routes_from_json(obj: dict[str, Any]) -> np.ndarray:
    dtype = np.dtype(obj["dtype"])
    data = np.frombuffer(base64.b64decode(obj["data"]), dtype=dtype.newbyteorder("<"))
    return data.reshape(obj["shape"]).astype(dtype)


def decode_outputs(outputs: Any) -> Any:
    """A client's view of /generate outputs (a dict or a list of them): routed experts decoded
    back to the arrays an in-process engine returns."""
    for out in outputs if isinstance(outputs, list) else [outputs]:
        meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
        if isinstance(meta.get("routed_experts"), dict):
            meta["routed_experts"] = routes_from_json(meta["routed_experts"])
    return outputs


def handoff_methods() -> frozenset[str]:
    """The names of the prefill/decode handoff (HandoffClient's)."""
    return frozenset(name for name in dir(HandoffClient) if not name.startswith("_"))


def interface_methods() -> frozenset[str]:
    """The names every implementation must have, with EngineClient's signatures."""
    return frozenset(name for name in dir(EngineClient) if not name.startswith("_"))
