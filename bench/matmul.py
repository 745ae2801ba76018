"""The decode matmuls kernel by kernel: which one the default mode should take at each row count.

python bench/matmul.py [--rows 1,2,4,8,16,64] [--repeats 7]
A model's every layer matmul (qkv, o, gate_up, down; a separate random weight per layer, so a
pass reads them from DRAM as a decode step does) at each row count, float32 and bf16: oneDNN on
the packed weight, cpu_kernels.blocked_linear on the blocked copy and, for bf16, small_linear
over the plain weight; then the float32 head of a bf16 model: the bf16 weight blocked times the
two bf16 halves of x (invariant_logits), its float32 copy blocked, the float32 copy packed for
oneDNN and small_linear over the bf16 weight. The kernels alternate within every repeat; ms
medians and the ratio oneDNN / blocked are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from hotswap.engine.config import ModelConfig
from hotswap.engine.layers import cpu_kernels
from hotswap.engine.layers.linear import linear, pack
from hotswap.engine.models.fetch import ensure_model
from hotswap.engine.models.llama import InvariantHead, invariant_logits


def layer_weights(cfg: ModelConfig, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every decode layer matmul's weight [n, k], random, one per layer and projection."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = [(cfg.q_size + 2 * cfg.kv_size, h), (h, cfg.q_size), (2 * inter, h), (h, inter)]
    return [torch.randn(n, k, dtype=dtype) * 0.05
            for _ in range(cfg.num_layers) for n, k in shapes]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def compare(kernels: dict[str, callable], repeats: int, before=None) -> dict[str, float]:
    """ms medians of each kernel, all of them run in turn in every repeat (after one warm-up),
    each call after an untimed `before()` where given."""
    samples: dict[str, list[float]] = {name: [] for name in kernels}
    for i in range(repeats + 1):
        for name, fn in kernels.items():
            if before is not None:
                before()
            ms = timed(fn)
            if i:
                samples[name].append(ms)
    return {name: statistics.median(s) for name, s in samples.items()}


def onednn(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return linear(x, weight, packed=packed)


def every_layer(kernel, x: dict[int, torch.Tensor], weights: list[tuple]) -> None:
    """kernel(x of the weight's k, *args) for each (weight, *args), as a step runs them."""
    for w, *args in weights:
        kernel(x[w.shape[1]], *args)


def layers(cfg: ModelConfig, rows: list[int], repeats: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        weights = layer_weights(cfg, dtype)
        packed = [(w, w, pack(w)) for w in weights]
        blocked = [(w, cpu_kernels.block_pack(w)) for w in weights]
        plain = [(w, w) for w in weights]
        print(f"{cfg.num_layers} layers' matmuls, {str(dtype)[6:]}, ms:")
        for m in rows:
            x = {k: torch.randn(m, k, dtype=dtype) for k in {w.shape[1] for w in weights}}
            kernels = {"oneDNN": partial(every_layer, onednn, x, packed),
                       "blocked": partial(every_layer, cpu_kernels.blocked_linear, x, blocked)}
            if dtype == torch.bfloat16 and m <= 8:
                kernels["small_linear"] = partial(every_layer, cpu_kernels.small_linear, x, plain)
            ms = compare(kernels, repeats)
            cols = "  ".join(f"{k} {v:7.2f}" for k, v in ms.items())
            print(f"  {m:>3} rows  {cols}  oneDNN/blocked {ms['oneDNN'] / ms['blocked']:.2f}x")


def head(cfg: ModelConfig, rows: list[int], repeats: int) -> None:
    weight = torch.randn(cfg.vocab_size, cfg.hidden_size).bfloat16() * 0.05
    wide, norm = weight.float(), torch.ones(cfg.hidden_size)
    split, blocked = InvariantHead.of(norm, weight), InvariantHead.of(norm, wide)
    packed = pack(wide)
    flush = torch.ones(1 << 26)  # 256 MB read before each call: the head comes from DRAM
    print(f"the float32 head of a bf16 model, {cfg.vocab_size} x {cfg.hidden_size} from DRAM, "
          "ms:")
    for m in rows:
        hidden = torch.randn(m, cfg.hidden_size)
        kernels = {"split": partial(invariant_logits, hidden, split, 1e-5),
                   "blocked fp32": partial(invariant_logits, hidden, blocked, 1e-5),
                   "oneDNN fp32": partial(onednn, hidden, wide, packed)}
        if m <= 8:
            kernels["small_linear"] = partial(cpu_kernels.small_linear, hidden, weight)
        ms = compare(kernels, repeats, before=flush.sum)
        print(f"  {m:>3} rows  " + "  ".join(f"{k} {v:6.2f}" for k, v in ms.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are not built (make setup)")
    cfg = ModelConfig.from_path(ensure_model(args.model_path))
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch threads: {torch.get_num_threads()}")
    layers(cfg, rows, args.repeats)
    head(cfg, rows, args.repeats)


if __name__ == "__main__":
    main()
