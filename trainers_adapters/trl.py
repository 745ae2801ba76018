"""TRL with hotswap generating: a `VLLMClient`-compatible client and a GRPOTrainer backend.

Follows TRL 1.16.0: trl/generation/vllm_client.py (`VLLMClient.generate`, `update_named_params`,
`weight_update`, `reset_prefix_cache`, `get_server_info`, `init_communicator`) and
trl/generation/vllm_generation.py (`VLLMGeneration` in server mode: `sync_weights` streams every
parameter through `update_named_params` and then calls `reset_prefix_cache`).

    from hotswap.trainers_adapters.trl import use_hotswap
    args = GRPOConfig(..., use_vllm=True, vllm_mode="server")
    with use_hotswap(engine):                 # a hotswap Engine or RemoteEngine
        trainer = GRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...)
    trainer.train()

No vLLM is needed: TRL's own VLLMGeneration runs unchanged except for its `_init_vllm`, which
connects this client instead of vLLM's. Weights pushed in a sync are staged (generation held) and
commit as one version at `reset_prefix_cache`, which TRL calls at the end of every sync.
Over HTTP (RemoteEngine) the tensors travel as base64 safetensors in the request body.
Not here: `image_features`/multi-modal prompts, `chat`, `get_sequence_logprobs`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hotswap.engine import RemoteEngine
from hotswap.trainers_adapters.vllm import SamplingParams


class VLLMClient:
    """TRL's VLLMClient surface over a hotswap Engine (`engine=`) or a hotswap server URL."""

    def __init__(self, base_url: str | None = None, host: str = "0.0.0.0",
                 server_port: int = 8000, group_port: int = 51216,
                 connection_timeout: float = 0.0, *, engine: Any = None,
                 api_key: str | None = None, admin_key: str | None = None):
        if engine is None:
            engine = RemoteEngine(base_url or f"http://{host}:{server_port}", api_key=api_key,
                                  admin_key=admin_key)
        self.engine = engine
        self.group_port = group_port
        self._updating_weights = False
        self._staged = False  # pieces sent with commit=False and not yet committed

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0) -> None:
        if isinstance(self.engine, RemoteEngine):
            self.engine.health()

    def get_server_info(self) -> dict:
        # hotswap's logprobs are those of the distribution sampled from (vLLM's "processed").
        return {"model_config": {"logprobs_mode": "processed_logprobs"},
                "weight_transfer_config": {"backend": "hotswap"},
                "weight_version": self.engine.get_weight_version()}

    def get_world_size(self) -> int:
        return 1

    def generate(self, prompts: list[str] | list[list[int]], features: Any = None, n: int = 1,
                 repetition_penalty: float = 1.0, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, min_p: float = 0.0, max_tokens: int = 16,
                 logprobs: int | None = 0, structured_outputs_regex: str | None = None,
                 generation_kwargs: dict | None = None) -> dict[str, Any]:
        if features is not None:
            raise ValueError("features (images) are not supported")
        extra = dict(generation_kwargs or {})
        if structured_outputs_regex is not None:
            extra["structured_outputs"] = {"regex": structured_outputs_regex}
        params = SamplingParams(n=n, repetition_penalty=repetition_penalty,
                                temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                max_tokens=max_tokens, logprobs=logprobs, **extra)
        texts = all(isinstance(p, str) for p in prompts)
        if texts and not hasattr(self.engine, "tokenizer"):
            raise ValueError("text prompts need an in-process Engine; send token ids")
        outs = self.engine.generate(prompts if texts else None, params.to_hotswap(),
                                    None if texts else [list(p) for p in prompts],
                                    return_logprob=logprobs is not None,
                                    top_logprobs_num=logprobs or 0)
        outs = outs if isinstance(outs, list) else [outs]
        prompt_ids = ([self.engine.tokenizer.encode(p) for p in prompts] if texts
                      else [list(p) for p in prompts])
        result: dict[str, Any] = {"prompt_ids": prompt_ids,
                                  "completion_ids": [list(o["output_ids"]) for o in outs],
                                  "logprobs": None, "logprob_token_ids": None}
        if logprobs is not None:
            rows = [_logprob_rows(o["meta_info"], logprobs) for o in outs]
            result["logprobs"] = [[[lp for lp, _ in row] for row in seq] for seq in rows]
            result["logprob_token_ids"] = [[[t for _, t in row] for row in seq] for seq in rows]
        return result

    # weights

    def init_communicator(self, device: Any = 0) -> None:
        """Nothing to set up: tensors go in-process or in the HTTP body."""

    def close_communicator(self) -> None:
        """Nothing to tear down."""

    @contextmanager
    def weight_update(self) -> Iterator[None]:
        """Several update_named_param(s) calls committed as one version on exit."""
        self._updating_weights = True
        try:
            yield
        finally:
            self._updating_weights = False
        self._commit()

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        self.update_named_params([(name, str(weights.dtype).removeprefix("torch."),
                                   list(weights.shape))], iter([(name, weights)]))

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]],
                            named_params: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Staged; committed by reset_prefix_cache (TRL's next call) or weight_update's exit."""
        pairs = [(name, tensor.detach()) for name, tensor in named_params]
        expected = [m[0] for m in metadata]
        if [n for n, _ in pairs] != expected:
            raise ValueError("named_params do not follow metadata's names")
        result = self.engine.update_weights_from_tensor(pairs, None, False, commit=False)
        if not result["success"]:
            raise RuntimeError(result["message"])
        self._staged = True

    def update_model_params(self, model: torch.nn.Module) -> None:
        metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape))
                    for n, p in model.named_parameters()]
        self.update_named_params(metadata, ((n, p.data) for n, p in model.named_parameters()))
        self._commit()

    def reset_prefix_cache(self) -> None:
        """Commits the staged weights as one version, then drops the cached prefixes."""
        result = self.engine.flush_cache()
        if not result["success"]:
            raise RuntimeError(result["message"])
        self._staged = False

    def _commit(self) -> None:
        if not self._staged:  # committed already (reset_prefix_cache), or nothing was sent
            return
        result = self.engine.commit_weight_update()
        if not result["success"]:
            raise RuntimeError(result["message"])
        self._staged = False


def _logprob_rows(meta: dict, logprobs: int) -> list[list[tuple[float, int]]]:
    """vLLM's per-token rows: the sampled token first, then up to `logprobs` others by rank."""
    pairs = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [[] for _ in pairs]
    rows = []
    for (lp, tid), top in zip(pairs, tops):
        row = [(lp, tid)] + [(tlp, t) for tlp, t in top[:logprobs] if t != tid]
        rows.append(row[: logprobs + 1])
    return rows


def generation_backend(engine: Any) -> type:
    """TRL's VLLMGeneration with `_init_vllm` connecting hotswap instead of vLLM."""
    from trl.generation.vllm_generation import VLLMGeneration

    class HotswapGeneration(VLLMGeneration):
        def _init_vllm(self) -> None:
            if self.mode != "server":
                raise ValueError("use vllm_mode='server' with hotswap (it plays the server)")
            self.vllm_client = VLLMClient(engine=engine)
            self.accelerator.wait_for_everyone()

    return HotswapGeneration


@contextmanager
def use_hotswap(engine: Any) -> Iterator[None]:
    """GRPOTrainers built inside this block generate with `engine` (GRPOConfig: use_vllm=True,
    vllm_mode="server"); TRL has no backend registry, so its VLLMGeneration name is swapped."""
    import trl.trainer.grpo_trainer as grpo

    previous = grpo.VLLMGeneration
    grpo.VLLMGeneration = generation_backend(engine)
    try:
        yield
    finally:
        grpo.VLLMGeneration = previous
