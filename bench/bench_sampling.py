"""Time Sampler.sample at batch 64 over SmolLM2's vocabulary (49152) on CPU.

Usage: python bench/bench_sampling.py [--threads N] [--iters N]
Prints the median and best ms per call of each configuration; the machine is shared, so the
best of many calls is the steadier number.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hotswap.engine.core.sampling_params import SamplingParams
from hotswap.engine.executor.sampling import Sampler
from hotswap.engine.executor.sampling_batch_info import SamplingBatchInfo

CASES = {
    "greedy": {"temperature": 0.0},
    "temperature 0.7": {"temperature": 0.7},
    "top_p 0.9 + top_k 50": {"top_p": 0.9, "top_k": 50},
    "seeded temperature 1.0": {"temperature": 1.0, "seed": 1234},
    "top_p 0.95 (no top_k)": {"top_p": 0.95},
    "min_p 0.05": {"min_p": 0.05},
    "penalties (rep 1.1, freq 0.2)": {"repetition_penalty": 1.1, "frequency_penalty": 0.2},
}


def lm_like_logits(batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Zipf-shaped rows in random token order: a few likely tokens, a long thin tail."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.1 * ranks.log() * 2.0
    rows = [base[torch.randperm(vocab, generator=gen)] for _ in range(batch)]
    return torch.stack(rows) + torch.randn(batch, vocab, generator=gen) * 0.5


def time_case(params: dict, logits: torch.Tensor, iters: int, logprobs: bool) -> list[float]:
    bsz, vocab = logits.shape
    p = [SamplingParams.from_dict(params)] * bsz
    outputs = [list(range(i, i + 64)) for i in range(bsz)]
    prompts = [list(range(100, 400)) for _ in range(bsz)]
    sampler, gen = Sampler(), torch.Generator().manual_seed(0)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        info = SamplingBatchInfo.build(p, outputs, prompts, [64] * bsz, [2], vocab, "cpu")
        sampler.sample(logits, info, logprobs, 5 if logprobs else 0, gen)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = {"randn*3": torch.randn(64, 49152, generator=gen) * 3,
              "lm-like": lm_like_logits(64, 49152, gen)}
    print(f"B=64 V=49152 threads={args.threads}; ms per build+sample call: median / best")
    for name, params in CASES.items():
        cells = []
        for shape, logits in shapes.items():
            for logprobs in (False, True):
                t = time_case(params, logits, args.iters, logprobs)
                cells.append(f"{shape}{'+lp' if logprobs else ''} "
                             f"{statistics.median(t):6.2f}/{min(t):6.2f}")
        print(f"{name:30s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
