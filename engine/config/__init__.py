"""Frozen, layered configuration: model -> cache -> scheduler -> engine.

The model's (config.json) is `ModelConfig` (config/model.py); the engine's options are
`EngineConfig`, one server flag per field. Every "auto" value is resolved once, in
`EngineConfig.resolve`; nobody mutates config later.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hotswap.engine.config.model import ModelConfig
from hotswap.engine.cpu_features import auto_dtype, warn_emulated_bf16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = (None, "int8")
SPECULATIVE = (None, "ngram", "self", "draft")
# Dense and MoE Llama-family text models: the draft reads their embedding, head and rotary table.
DRAFT_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                       "Qwen3MoeForCausalLM", "MixtralForCausalLM")
ROLES = ("both", "prefill", "decode")

logger = logging.getLogger(__name__)

__all__ = ["ATTENTION_BACKENDS", "DTYPES", "EngineConfig", "ModelConfig", "option",
           "resolve_attention_backend"]


def option(default: Any, help: str, choices: tuple[Any, ...] = ()) -> Any:
    """A config field with what its server flag says (the server has one flag per field)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: str = "auto"
    device: str = "auto"
    max_total_tokens: int | None = None
    page_size: int = 1
    max_running_requests: int = 256
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 8192
    schedule_policy: str = option("lpm", "admission order: longest prefix match first, or "
                                  "first come first served", ("lpm", "fcfs"))
    attention_backend: str = "auto"
    enable_prefix_cache: bool = True
    seed: int = 0
    deterministic: bool = False
    mem_fraction: float = 0.3
    context_length: int | None = None
    weight_update_timeout_s: float = 300.0
    session_budget_fraction: float = option(
        0.25, "sessions (open_session): the share of the KV pool their pinned turns may hold "
        "together")
    check_weights_finite: bool = option(
        True, "refuse weight updates holding NaN or inf before any write (one extra pass over "
        "the data)")
    # Distributed updates: "standby" receives beside the live weights (one extra copy of them,
    # kept) and swaps them in at commit; "none" receives in place (engine/weights/receive.py).
    weight_staging: str = option(
        "standby", "where a distributed update lands unless the call says: standby (one extra "
        "copy of the weights; a bad tensor is refused before any write) or none (in place; a "
        "bad tensor stops generation until a complete update)")
    # About 12% faster decode, ~150 ms to rebuild for SmolLM2-135M after weights change.
    pack_weights: bool = option(
        True, "CPU float32: keep a oneDNN-blocked copy of every matmul weight (twice the "
        "weight memory)")
    enable_weights_cpu_backup: bool = option(
        False, "keep a host copy of the weights across release_memory_occupation (SGLang's "
        "name): resume then restores them, so a colocated trainer need not push weights before "
        "generating")
    tp_size: int = option(  # checked, and torchrun's environment read, in distributed/launch.py
        1, "tensor-parallel ranks (worker processes started by the server; each joins a "
        "trainer's weight-update group itself)")
    ep_size: int = option(
        1, "expert parallelism (SGLang's name) is not implemented: anything but 1 is refused; "
        "tp_size splits every expert's intermediate dimension instead (docs/moe.md)")
    launcher: str = option("spawn", "spawn (the engine alone) or torchrun (one engine per rank "
                           "of a torchrun job)")
    max_lora_rank: int = option(64, "the largest LoRA rank an adapter may have")
    max_loras_per_batch: int = option(
        8, "distinct LoRA adapters in one step; also the adapter pool's slots")
    # Vision-language models (engine/multimodal/).
    image_min_pixels: int | None = option(
        None, "images are resized to at least this many pixels (None: the model's "
        "preprocessor_config.json)")
    image_max_pixels: int | None = option(
        None, "images are resized to at most this many pixels (None: the model's "
        "preprocessor_config.json)")
    encoder_cache_mb: float = option(
        256.0, "the vision encoder's outputs kept per (weights, adapter, image), least recently "
        "used dropped first; 0 keeps none")
    # HiCache (engine/kvcache/hiradix_cache.py).
    enable_hierarchical_cache: bool = option(
        False, "write evicted prefix KV to a host tier and load it back on a match")
    hicache_ratio: float = option(2.0, "host tier size as a multiple of the device KV pool")
    hicache_host_tokens: int | None = option(
        None, "host tier size in tokens (overrides hicache_ratio)")
    hicache_storage_dir: str | None = option(
        None, "folder of prefix KV files shared by engine processes on this machine")
    hicache_write_policy: str = option(
        "write_back", "write_through: also write a request's prefix down when it leaves the "
        "batch, so other processes find it before the device evicts it",
        ("write_back", "write_through"))
    grammar_backend: str = option("xgrammar", "none: grammar requests are refused",
                                  ("xgrammar", "none"))
    fp32_lm_head: bool = option(
        True, "bf16/fp16 models: final norm, lm_head and log-softmax in float32 (logprobs fit "
        "for RL; a float32 copy of the lm_head weight); off: the lm_head runs in the model's "
        "dtype")
    # The int8 copies are rebuilt inside every weight update (layers/quant.py).
    quantization: str | None = option(
        None, "int8: every linear layer but the lm_head as int8 weights x int8 activations "
        "(CPU); the trainer keeps sending full-precision weights", ("int8",))
    quantize_lm_head: bool = option(
        False, "with quantization int8: the lm_head too (faster, larger logprob error)")
    # Each KV slot then also holds its token's routing (docs/moe.md).
    enable_return_routed_experts: bool = option(
        False, "MoE models: requests may ask for the experts every token was routed to "
        "(return_routed_experts)")
    # Speculative decoding (engine/speculative/): the target verifies every draft, so tokens,
    # logprobs and versions are the target's; the draft length of a step follows measured
    # acceptance and step times, up to speculative_num_draft_tokens (0 where it does not pay).
    speculative: str | None = option(
        None, "speculative decoding: n-gram drafts from the request's own prompt and output, "
        "the policy's own first speculative_self_layers layers, or a learned draft (an "
        "EAGLE-style head trained on the policy, updated with its weights)",
        ("ngram", "self", "draft"))
    speculative_num_draft_tokens: int = option(
        8, "the longest draft of a step (the length is chosen by measurement)")
    speculative_self_layers: int | None = option(
        None, "layers of the self-draft (default: calibrated on the first running requests)")
    speculative_draft_path: str | None = option(
        None, "speculative='draft': the draft's folder (default: the model's draft/, which "
        "python -m hotswap.engine.speculative.train_draft writes)")
    served_model_name: str | None = option(
        None, "the name requests and updates address it by (model=); default: the folder's")
    frozen: bool = option(False, "a reward model or judge: weight updates must name it")
    role: str = option("both", "prefill/decode disaggregation (docs/fleet.md#prefill-and-decode): "
                       "prefill serves prompts' KV and first tokens, decode serves handed-off "
                       "and plain requests", ROLES)

    def resolve(self, model: ModelConfig) -> EngineConfig:
        """Resolve every "auto" and validate; returns a new config."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        dtype = self.dtype
        if dtype == "auto":
            dtype, why = auto_dtype(device, model.torch_dtype)
            logger.info("dtype='auto' -> %s: %s", dtype, why)
        warn_emulated_bf16(device, dtype)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
        backend = resolve_attention_backend(self.attention_backend, device, dtype)
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(
                f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}")
        if not 0 <= self.session_budget_fraction <= 1:
            raise ValueError("session_budget_fraction must be in [0, 1]")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        self._check_hicache()
        self._check_role()
        self._check_quantization(device)
        self._check_routed_experts(model)
        self._check_speculative(model)
        for name in ("image_min_pixels", "image_max_pixels"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (self.image_min_pixels or 0) > (self.image_max_pixels or float("inf")):
            raise ValueError("image_min_pixels must not exceed image_max_pixels")
        if not self.encoder_cache_mb >= 0:
            raise ValueError(f"encoder_cache_mb must be >= 0, got {self.encoder_cache_mb}")
        if model.vision is not None and self.tp_size != 1:
            raise ValueError(f"{model.architecture} with tp_size={self.tp_size}: the vision "
                             "tower is not split over ranks; use tp_size=1")
        if self.ep_size != 1:
            raise ValueError(f"ep_size={self.ep_size}: expert parallelism is not supported; "
                             "tp_size splits every expert over the ranks instead")
        context = self._context_length(model)
        draft = self.speculative_draft_path
        if self.speculative == "draft" and draft is None:
            draft = os.path.join(self.model_path, "draft")
        return replace(self, device=device, dtype=dtype, attention_backend=backend,
                       context_length=context, served_model_name=self._model_name(),
                       speculative_draft_path=draft)

    def _model_name(self) -> str:
        name = self.served_model_name or os.path.basename(os.path.normpath(self.model_path))
        if not isinstance(name, str) or ":" in name:  # "name:adapter" addresses an adapter
            raise ValueError(f"served_model_name must be a string without ':', got {name!r}")
        return name

    def _context_length(self, model: ModelConfig) -> int:
        """context_length, or the model's; within a sliding window, which is not implemented:
        up to the window, full attention is what the checkpoint computes."""
        context = self.context_length or model.max_position_embeddings
        window = model.sliding_window
        if window is None or window >= context:
            return context
        if self.context_length is not None:
            raise ValueError(
                f"context_length={self.context_length}: the model's attention slides over "
                f"{window} tokens, which is not implemented; give context_length <= {window}")
        logger.warning("the model's attention slides over %d tokens, which is not implemented: "
                       "context_length set to %d (of max_position_embeddings %d)", window,
                       window, model.max_position_embeddings)
        return window

    def _check_role(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.role == "both":
            return
        if self.tp_size != 1:
            raise ValueError(f"role={self.role!r} with tp_size={self.tp_size}: a KV handoff "
                             "reads and writes one process's KV pool; use tp_size=1")
        if self.role == "decode" and not self.enable_prefix_cache:
            raise ValueError("role='decode' needs enable_prefix_cache=True: handed-off KV "
                             "enters the radix cache, where the request finds it")

    def _check_quantization(self, device: str) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got "
                             f"{self.quantization!r}")
        if self.quantization is not None and device != "cpu":
            raise ValueError(f"quantization={self.quantization!r} runs on CPU only, not on "
                             f"device={device!r}")
        if self.quantization is not None and self.deterministic:
            raise ValueError(f"quantization={self.quantization!r} with deterministic=True: the "
                             "batch-invariant kernels multiply float32 and bf16 weights only")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs quantization='int8'")

    def _check_routed_experts(self, model: ModelConfig) -> None:
        if not self.enable_return_routed_experts:
            return
        if model.num_experts == 0:
            raise ValueError(f"enable_return_routed_experts: {model.architecture} has no "
                             "mixture-of-experts layers")
        if self.enable_hierarchical_cache:
            raise ValueError("enable_return_routed_experts with enable_hierarchical_cache: the "
                             "host and storage tiers do not keep the routing of their KV")

    def _check_speculative(self, model: ModelConfig) -> None:
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {SPECULATIVE}, got "
                             f"{self.speculative!r}")
        if not 1 <= self.speculative_num_draft_tokens <= 16:
            raise ValueError("speculative_num_draft_tokens must be in [1, 16], got "
                             f"{self.speculative_num_draft_tokens}")
        layers = self.speculative_self_layers
        if layers is not None and (self.speculative != "self"
                                   or not 1 <= layers < model.num_layers):
            raise ValueError(f"speculative_self_layers={layers}: needs speculative='self' and "
                             f"a value in [1, {model.num_layers - 1}]")
        if self.speculative_draft_path is not None and self.speculative != "draft":
            raise ValueError("speculative_draft_path needs speculative='draft'")
        if self.speculative == "draft" and (model.architecture not in DRAFT_ARCHITECTURES
                                            or self.tp_size != 1):
            raise ValueError(f"speculative='draft' runs on a text model of "
                             f"{', '.join(DRAFT_ARCHITECTURES)} with tp_size=1; "
                             f"got {model.architecture} with tp_size={self.tp_size}")

    def _check_hicache(self) -> None:
        if not self.enable_hierarchical_cache:
            for name in ("hicache_host_tokens", "hicache_storage_dir"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs enable_hierarchical_cache=True")
            if self.hicache_write_policy != "write_back":
                raise ValueError("hicache_write_policy needs enable_hierarchical_cache=True")
            return
        if self.hicache_write_policy not in ("write_back", "write_through"):
            raise ValueError("hicache_write_policy must be 'write_back' or 'write_through', got "
                             f"{self.hicache_write_policy!r}")
        if not self.enable_prefix_cache or self.deterministic:
            raise ValueError("enable_hierarchical_cache needs the prefix cache "
                             "(enable_prefix_cache=True, deterministic=False)")
        if self.hicache_host_tokens is not None and self.hicache_host_tokens < self.page_size:
            raise ValueError(f"hicache_host_tokens must be at least one page ({self.page_size} "
                             f"tokens), got {self.hicache_host_tokens}")
        if not self.hicache_ratio > 0:
            raise ValueError(f"hicache_ratio must be > 0, got {self.hicache_ratio}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


# Backends whose kernels exist only for some KV dtypes (flashinfer has no float32 kernels).
BACKEND_DTYPES = {"flashinfer": ("float16", "bfloat16")}
# The attention backends' names, listed once: engine/attention/__init__.py maps each to its class.
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")


def resolve_attention_backend(backend: str, device: str, dtype: str) -> str:
    """"auto": flashinfer on CUDA where it imports and has kernels for the dtype, else Triton
    (float32 included), else torch; on CPU torch. An explicit choice is checked against the
    dtype here, so a float32 engine never fails later inside the backend's constructor."""
    if backend == "auto":
        return _auto_attention_backend(device, dtype)
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be 'auto' or one of {ATTENTION_BACKENDS}, "
                         f"got {backend!r}")
    if dtype not in BACKEND_DTYPES.get(backend, (dtype,)):
        raise ValueError(f"attention_backend={backend!r} supports dtype "
                         f"{' or '.join(BACKEND_DTYPES[backend])}, not {dtype}; use "
                         "attention_backend='triton' or 'torch' (or 'auto')")
    return backend


def _auto_attention_backend(device: str, dtype: str) -> str:
    if device != "cuda":
        return "torch"
    if dtype in BACKEND_DTYPES["flashinfer"] and _importable("flashinfer"):
        return "flashinfer"
    return "triton" if _importable("triton") else "torch"


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
