"""TRL's own GRPOTrainer, two steps on a tiny random Llama, with hotswap generating and receiving
the weights after each step (hotswap.trainers_adapters.trl); no vLLM installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fixtures import write_tiny_chat_model

from hotswap.engine import Engine

trl = pytest.importorskip("trl", reason="trl is a dev extra (pip install -e .[dev])")
pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "Hello, how are you", "Write a short poem about the sea",
           "Numbers 0 1 2 3"]


def engine_logprobs(engine: Engine, ids: list[int]) -> tuple[list[int], list[float]]:
    out = engine.generate(None, {"max_new_tokens": 8, "temperature": 1.0, "seed": 5,
                                 "ignore_eos": True}, ids, return_logprob=True)
    pairs = out["meta_info"]["output_token_logprobs"]
    return [t for _, t in pairs], [lp for lp, _ in pairs]


def model_logprobs(model: torch.nn.Module, ids: list[int], out_ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids + out_ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)
    return logp[torch.arange(len(out_ids)), torch.tensor(out_ids)].tolist()


def test_grpo_trainer_trains_two_steps_with_hotswap_generating(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from hotswap.trainers_adapters.trl import use_hotswap

    assert importlib.util.find_spec("vllm") is None
    path = write_tiny_chat_model(str(tmp_path / "model"))

    def reward_len(completions: list[str], **kwargs) -> list[float]:
        return [float(len(c)) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_vllm=True, vllm_mode="server",
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      max_steps=2, learning_rate=5e-2, logging_steps=1, report_to="none",
                      save_strategy="no", use_cpu=True, bf16=False, seed=0,
                      dataloader_num_workers=0)
    with Engine(path, max_total_tokens=4096) as engine:
        with use_hotswap(engine):
            trainer = GRPOTrainer(model=path, reward_funcs=reward_len, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}))
        result = trainer.train()
        assert trainer.state.global_step == 2 and result.training_loss == result.training_loss
        # A sync before each step's generation: version 0 -> 1 (step 0) -> 2 (step 1).
        assert engine.get_weight_version() == "2"

        model = trainer.model.eval()
        ids = engine.tokenizer.encode(PROMPTS[0])
        out_ids, stale = engine_logprobs(engine, ids)
        # The last optimizer step came after the last sync: the engine is one step behind.
        assert max(abs(a - b) for a, b in zip(stale, model_logprobs(model, ids, out_ids))) > 1e-3

        trainer.vllm_generation.sync_weights()  # what TRL runs before the next generation
        assert engine.get_weight_version() == "3"
        out_ids, fresh = engine_logprobs(engine, ids)
        want = model_logprobs(model, ids, out_ids)
        print(f"\nGRPO 2 steps: loss {result.training_loss:.4f}; engine version "
              f"{engine.get_weight_version()}; max |engine - trainer| logprob "
              f"{max(abs(a - b) for a, b in zip(fresh, want)):.2e}")
        torch.testing.assert_close(torch.tensor(fresh), torch.tensor(want), atol=1e-4, rtol=0)
