"""Writes verl's RL dataset for single-digit addition: train.parquet and val.parquet.

    python examples/verl/addition_data.py OUT_DIR [--train 64] [--val 8]

Each row is what verl's RLHFDataset reads: a chat `prompt`, `data_source`, and
`reward_model.ground_truth` for the reward function (examples/verl/reward.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from hotswap.rollout.grpo import addition_rows

DATA_SOURCE = "hotswap/addition"


def rows(count: int, seed: int) -> list[dict]:
    """The main job's questions (hotswap.rollout.grpo), in verl's row format."""
    return [{"data_source": DATA_SOURCE, "ability": "math", "prompt": row["messages"],
             "reward_model": {"style": "rule", "ground_truth": str(row["answer"])},
             "extra_info": {"index": index, "question": row["messages"][-1]["content"]}}
            for index, row in enumerate(addition_rows(count, seed))]


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
