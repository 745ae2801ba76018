"""TRL's GRPOTrainer with hotswap generating (no vLLM): two lines differ from a vLLM setup.

python examples/trl_grpo.py [--steps 2]
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model
from hotswap.trainers_adapters.trl import use_hotswap


def reward_short(completions: list, **kwargs) -> list[float]:
    return [-abs(len(str(c)) - 40) / 40 for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    path = ensure_model()
    prompts = [[{"role": "user", "content": q}] for q in
               ("Name a primary color.", "What do bees make?", "What is 2 + 2?", "Say hello.")]
    config = GRPOConfig(output_dir="/tmp/hotswap-grpo", use_vllm=True, vllm_mode="server",
                        per_device_train_batch_size=4, num_generations=4,
                        max_completion_length=24, max_steps=args.steps, learning_rate=1e-5,
                        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                        bf16=False)  # TRL's default bf16 autocast would score in bf16
    with Engine(path) as engine:
        with use_hotswap(engine):  # instead of `vllm serve` + the trainer's VLLMClient
            trainer = GRPOTrainer(model=path, reward_funcs=reward_short, args=config,
                                  train_dataset=Dataset.from_dict({"prompt": prompts * 8}))
        trainer.train()
        print("engine weight version after training:", engine.get_weight_version())


if __name__ == "__main__":
    main()
