"""Writes verl's RL dataset for single-digit addition: train.parquet and val.parquet.

    python examples/verl/addition_data.py OUT_DIR [--train 64] [--val 8]

Each row is what verl's RLHFDataset reads: a chat `prompt`, `data_source`, and
`reward_model.ground_truth` for the reward function (examples/verl/reward.py).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pandas as pd

DATA_SOURCE = "hotswap/addition"


def rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        question = f"What is {a} + {b}? Reply with just the number."
        out.append({"data_source": DATA_SOURCE, "ability": "math",
                    "prompt": [{"role": "user", "content": question}],
                    "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                    "extra_info": {"index": index, "question": question}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--val", type=int, default=8)
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows(args.train, seed=0)).to_parquet(out / "train.parquet")
    pd.DataFrame(rows(args.val, seed=1)).to_parquet(out / "val.parquet")
    print(f"wrote {args.train} + {args.val} rows to {out}")


if __name__ == "__main__":
    main()
