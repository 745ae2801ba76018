"""Decode attention against the machine's read bandwidth: the long tail's regime.

python bench/attention.py [--shapes 1x2048,2x2048,4x2048,8x1024,64x200] [--dtype bfloat16,float32]
                          [--repeats 7]
For each shape (rows x keys per row), a model's every layer (SmolLM2's 30 x 3 KV heads of 64 by
default) runs cpu_kernels.decode_attention over a KV pool allocated as the engine allocates it
(kvcache.memory.KVPool), each row's prompt in consecutive slots and its last 64 keys a slot per
decode step apart, as a batch decoding together leaves them. Printed: ms per pass over the
layers (the best of `--repeats`), GB/s of K and V read, and that as a share of the read
bandwidth measured in the same run (a float32 sum over 0.5 GiB).
"""

from __future__ import annotations

import argparse
import time

import torch

from hotswap.engine.config import ModelConfig
from hotswap.engine.kvcache.memory import KVPool
from hotswap.engine.layers import cpu_kernels
from hotswap.engine.models.fetch import ensure_model

DECODED = 64  # each row's last keys: one slot per decode step of the batch


def slot_table(rows: int, keys: int) -> torch.Tensor:
    """[rows, keys] pool slots: each row's first keys - DECODED consecutive, then one slot per
    row per step, interleaved (slot 0 is the pool's reserved zero page)."""
    prompt = max(keys - DECODED, 0)
    table = torch.empty(rows, keys, dtype=torch.int64)
    table[:, :prompt] = 1 + torch.arange(rows * prompt).view(rows, prompt)
    steps = keys - prompt
    table[:, prompt:] = 1 + rows * prompt + torch.arange(steps * rows).view(steps, rows).T
    return table


def best_ms(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples) * 1e3


def read_bandwidth(repeats: int) -> float:
    buf = torch.ones((1 << 29) // 4)
    return buf.numel() * 4 / best_ms(buf.sum, repeats) * 1e3 / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1x2048,2x2048,4x2048,8x1024,64x200")
    parser.add_argument("--dtype", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are not built here (python -m "
                         "hotswap.engine.layers.cpu_kernels says why)")
    cfg = ModelConfig.from_path(ensure_model())
    hkv, d, layers = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    scale = d ** -0.5
    print(f"threads {torch.get_num_threads()}; {layers} layers x {hkv} KV heads of {d}, "
          f"{cfg.num_heads} query heads")
    print(f"{'dtype':<10}{'rows x keys':>12}{'ms':>9}{'GB/s':>8}  share of read bandwidth")
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        for shape in args.shapes.split(","):
            rows, keys = (int(v) for v in shape.split("x"))
            table = slot_table(rows, keys)
            pages = int(table.max()) + 1
            pool = KVPool(pages, 1, layers, hkv, d, dtype, "cpu")
            for buf in pool.k_buffers + pool.v_buffers:
                buf.normal_()
            q = torch.randn(rows, cfg.num_heads * d, dtype=dtype)
            lens = torch.full((rows,), keys, dtype=torch.int64)
            idx = torch.arange(rows)

            def attend(pool=pool, q=q, table=table, lens=lens, idx=idx):
                for k_buf, v_buf in zip(pool.k_buffers, pool.v_buffers):
                    cpu_kernels.decode_attention(q, k_buf, v_buf, table, idx, lens, scale)

            ms = best_ms(attend, args.repeats)
            gbs = rows * keys * layers * 2 * hkv * d * q.element_size() / ms * 1e3 / 1e9
            bandwidth = read_bandwidth(args.repeats)
            print(f"{name:<10}{shape:>12}{ms:9.2f}{gbs:8.1f}  {gbs / bandwidth:.0%} of "
                  f"{bandwidth:.1f}")
            pool.release()


if __name__ == "__main__":
    main()
