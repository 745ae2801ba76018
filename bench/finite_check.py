"""The cost of refusing non-finite weight updates, on SmolLM2-135M (fp32, ~540 MB).

python bench/finite_check.py [--repeats 5]

In one process, alternating what is compared: the check alone as the engine runs it (a sum per
tensor, exact test only when a sum is not finite), the same check written as
`torch.isfinite(t).all()` per tensor, and a whole `update_weights_from_tensor` of every tensor
(which includes the check) on an engine with the check on and one with it off. Medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from safetensors.torch import load_file

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model
from hotswap.engine.models.loader import check_finite


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    path = ensure_model()
    tensors = load_file(f"{path}/model.safetensors")
    items = list(tensors.items())
    megabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    engines = {on: Engine(path, max_total_tokens=4096, check_weights_finite=on)
               for on in (True, False)}
    cases: dict[str, Callable[[], object]] = {
        "check (sum, engine's)": lambda: check_finite(items),
        "check (isfinite.all)": lambda: [bool(torch.isfinite(t).all()) for _, t in items],
        "update, check on": lambda: engines[True].update_weights_from_tensor(items),
        "update, check off": lambda: engines[False].update_weights_from_tensor(items),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(args.repeats):
            for name, fn in cases.items():
                times[name].append(timed(fn))
    finally:
        for engine in engines.values():
            engine.shutdown()
    print(f"{len(items)} tensors, {megabytes:.0f} MB, torch threads {torch.get_num_threads()}")
    for name, values in times.items():
        print(f"{name:24s} median {1000 * statistics.median(values):7.1f} ms")


if __name__ == "__main__":
    main()
