"""A GRPO batch from the engine: groups of 4 samples per prompt, exact-match reward, masks.

python examples/rollout_collect.py
"""

from __future__ import annotations

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model
from hotswap.rollout import SingleTurn, TokenClient, collect, exact_match, nonzero_std

ROWS = [{"messages": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number."}],
         "answer": a + b} for a, b in [(2, 3), (4, 4), (7, 1), (6, 3), (5, 5), (9, 2)]]

if __name__ == "__main__":
    with Engine(ensure_model(None), dtype="float32") as engine:
        client = TokenClient(engine, sampling={"temperature": 1.0, "max_new_tokens": 16})
        batch = collect(client, SingleTurn(), ROWS, group_size=4, reward=exact_match(),
                        filter=nonzero_std(), target_groups=2, over_sample=2)
        print("groups", batch.meta["groups"])
        for text, r, a in zip((t.text for t in batch.trajectories), batch.rewards,
                              batch.advantages):
            print(f"reward {r:.0f} advantage {a:+.2f} {text!r}")
        tensors = batch.to_tensors(pad_id=engine.tokenizer.pad_token_id)
        print({k: tuple(v.shape) for k, v in tensors.items()})
