"""ModelRunner: owns the model weights, the KV memory and the attention backend; runs one forward.

It knows nothing of requests or scheduling: it takes a ForwardBatch and returns logits.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from hotswap.engine.attention import get_backend_class
from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.core.forward_batch import ForwardBatch
from hotswap.engine.kvcache.memory import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from hotswap.engine.layers import cpu_kernels, quant
from hotswap.engine.models import build_model
from hotswap.engine.models.draft import DraftModel, load_draft
from hotswap.engine.models.loader import load_checkpoint

logger = logging.getLogger(__name__)

# Without a stated pool size on CPU, never take more than this many tokens by default.
_CPU_DEFAULT_MAX_TOKENS = 262_144


class ModelRunner:
    # Whether this runner drives tensor-parallel workers (TPModelRunner): a weight update is
    # then received on every rank (WeightSyncDriver's methods) instead of by this process.
    tensor_parallel = False

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        torch.manual_seed(config.seed)
        with torch.device("meta"):  # no random init: every parameter is loaded below
            model = build_model(model_config, config.context_length)
            if config.speculative == "draft":  # its tensors join the policy's (an update's)
                model.draft = DraftModel(model_config)
        self.model = model.to_empty(device=self.device).to(self.dtype)
        self.model.eval().requires_grad_(False)
        self._flatten_parameters()
        self._load_weights()
        self.weight_map = self.model.hf_weight_map()
        # Packed weights (layers/linear.py) are rebuilt before the first forward that follows
        # a change: every write to the weights calls weights_changed().
        self._weights_generation = 0
        self._packed_generation = -1
        self.last_pack_s = 0.0  # how long the last rebuild of the packed copies took
        self.quant_bytes = 0  # what the int8 copies hold
        if config.quantization is not None:
            quant.fast_path()  # logs whether int8 runs fast here, and why not
        # deterministic=True: every kernel batch-invariant where this build has them (the CPU
        # kernels), else each row runs alone (the scheduler) with the prefix cache off.
        self.batch_invariant = config.deterministic and self._invariant_kernels()
        self.refresh_derived()

        page_size = config.page_size
        num_pages = self._num_kv_tokens() // page_size
        if num_pages < 2:
            raise ValueError("max_total_tokens leaves fewer than two KV pages")
        route_shape = ((model_config.num_moe_layers, model_config.num_experts_per_tok)
                       if config.enable_return_routed_experts else None)
        # On CPU the pool asks for 2 MiB pages: the attention's reads of a row's keys cross a
        # page 512 times less often (docs/performance.md).
        self.kv_pool = KVPool(num_pages, page_size, model_config.num_layers,
                              model_config.num_kv_heads, model_config.head_dim, self.dtype,
                              self.device, route_shape, empty=cpu_kernels.huge_empty)
        self.allocator = TokenToKVPoolAllocator(num_pages, page_size)
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests + 1,
                                                config.context_length + 1, self.device)
        backend_cls = get_backend_class(config.attention_backend)
        self.attn_backend = backend_cls(
            self.kv_pool, self.req_to_token_pool.req_to_token, model_config.num_heads,
            model_config.num_kv_heads, model_config.head_dim, model_config.head_dim ** -0.5)
        self.attn_backend.batch_invariant = self.batch_invariant
        # A learned draft's inputs: the policy's normed last hidden state at every KV slot.
        self.features = (torch.zeros((self.kv_pool.num_slots, model_config.hidden_size),
                                     dtype=self.dtype, device=self.device)
                         if config.speculative == "draft" else None)

    def _invariant_kernels(self) -> bool:
        """Whether this runner's forward can be batch-invariant: the CPU kernels built and
        every matmul weight fits their blocked layout
        (docs/rl.md#deterministic-rollouts-and-exact-logprobs).
        Where the kernels are missing (CUDA, HOTSWAP_CPU_KERNELS=0) deterministic=True falls
        back to rows run alone; a model they cannot take is refused."""
        if self.device.type != "cpu" or not cpu_kernels.available():
            logger.warning("deterministic=True without the CPU kernels: every row runs alone "
                           "and the prefix cache is off (slow)")
            return False
        misfits = self.model.unblockable()
        if misfits:
            raise ValueError("deterministic=True: the batch-invariant matmul needs every weight's "
                             "output count a multiple of 32 (and, in bf16, an even input "
                             f"count); these do not fit: {', '.join(misfits[:4])}")
        return True

    def _load_weights(self) -> None:
        load_checkpoint(self.model, self.config.model_path)
        if self.config.speculative == "draft":
            load_draft(self.model.draft, self.config.speculative_draft_path)

    def shutdown(self) -> None:
        """Nothing to stop in one process (a tensor-parallel runner stops its workers)."""

    def check_alive(self) -> None:
        """Raises when the runner cannot run forwards any more (a tensor-parallel worker died)."""

    def _flatten_parameters(self) -> None:
        """Lay every parameter out in one buffer, in HF module order.

        A trainer's bucket of consecutive same-dtype tensors then covers one contiguous span of
        the engine's storage, and the receiver broadcasts straight into it (no staging copy).
        """
        params = {id(s.param): s.param for s in self.model.hf_weight_map().values()}
        self._param_shapes = [(p, p.shape) for p in params.values()]
        self._allocate_parameters()

    def _allocate_parameters(self) -> None:
        total = sum(shape.numel() for _, shape in self._param_shapes)
        # In 2 MiB pages on CPU: the kernels of few-row steps stream the plain weights.
        flat = cpu_kernels.huge_empty((total,), self.dtype, self.device)
        offset = 0
        for p, shape in self._param_shapes:
            p.data = flat[offset: offset + shape.numel()].view(shape)
            offset += shape.numel()
        self.weights_released = False

    def release_weights(self) -> None:
        """Free the parameter storage (and the int8 and blocked copies); their values are gone
        until weights are pushed again."""
        for p, _ in self._param_shapes:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.weights_released = True
        self.weights_changed()
        self.model.quantize_weights(False)
        self.model.pack_regions.clear()

    def resume_weights(self) -> None:
        """Storage back (values undefined)."""
        if self.weights_released:
            self._allocate_parameters()
            self.weights_changed()

    def weights_changed(self) -> None:
        """Called after any write to the weights: packed and int8 copies are stale from now on.
        The packed copies are dropped, so a rebuild never holds two sets; the int8 copies are
        kept for their memory, which the rebuild (before any forward reads them) writes again:
        fresh pages would cost an update more than the quantization itself."""
        self._weights_generation += 1
        self.model.pack_weights(False)
        self.model.build_fp32_head(False, False)

    def refresh_derived(self, lap: Callable[[str], None] | None = None) -> None:
        """Rebuild the packed and int8 copies of the current weights now, where stale: a weight
        update calls it inside its transaction (paused), so its first step pays nothing and a
        quantization error fails the update; otherwise the next forward does. `lap` (a
        weight update's Stages.lap) is told "quantize" after the int8 copies and "derive" after
        the rest (the float32 head and packed copies, which a float engine rebuilds too)."""
        if self._packed_generation == self._weights_generation or self.weights_released:
            return
        config = self.config
        start = time.perf_counter()
        if config.quantization is not None:  # first: packing skips what has an int8 copy
            self.quant_bytes = self.model.quantize_weights(True, config.quantize_lm_head)
            if lap is not None:
                lap("quantize")
        self.model.build_fp32_head(config.fp32_lm_head and not config.quantize_lm_head
                                   and not self.batch_invariant, config.pack_weights)
        self.model.pack_weights(config.pack_weights, self.batch_invariant)
        if lap is not None:
            lap("derive")
        self._packed_generation = self._weights_generation
        self.last_pack_s = time.perf_counter() - start

    def _num_kv_tokens(self) -> int:
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        mc = self.model_config
        per_token = 2 * mc.num_layers * mc.kv_size * self.dtype.itemsize
        if self.config.speculative == "draft":  # its layer's KV and the stored hidden state
            per_token += (2 * mc.kv_size + mc.hidden_size) * self.dtype.itemsize
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.mem_fraction) // per_token
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(int(available * self.config.mem_fraction) // per_token,
                   _CPU_DEFAULT_MAX_TOKENS)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 logits [len(fb.logits_indices), vocab]."""
        self.refresh_derived()
        fb.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(fb)
        pool = self.kv_pool
        fb.features = self.features if fb.num_layers is None else None
        if pool.routes is None or fb.num_layers is not None:  # a draft's routing is not kept
            return self.model(fb)
        fb.routes = torch.empty((fb.num_tokens, *pool.route_shape), dtype=pool.routes.dtype,
                                device=self.device)
        logits = self.model(fb)
        pool.routes.index_copy_(0, fb.out_cache_loc.to(self.device), fb.routes)
        return logits
