"""Throughput: hotswap (bf16 and fp32) vs HF transformers `generate`: same model, prompts, machine.

python bench/throughput.py [--dtype bfloat16,float32] [--workloads a,b,1,c,t,p] [--repeats 1]
                           [--skip-hf] [--no-roofline] [--no-logprob-check]
                           [--quantization int8 [--quantize-lm-head]] [--deterministic]
(a) 64 distinct chat prompts x 64 new tokens; (b) GRPO-style 8 prompts x n=8 x 64 new tokens; (1)
batch 1: one chat prompt x 64 new tokens; (c) a ~1,000-token shared system prompt + 64 short
questions x 32 new tokens; (t) the long tail of a GRPO batch: 4 distinct ~2,000-token prompts x 64
new tokens, decoded on their cached prompts (a first call prefills them, uncounted; HF is not run
on it); (p) prefill: the same 4 prompts from an empty cache, one new token each, rated in prompt
tokens computed per second (HF not run). Sampling at temperature 1.0, eos ignored on both sides so
every request makes its full length. Every engine (one per dtype) and HF (fp32) run in their own
process, and each repeat runs them one after the other, so a slow period of this shared machine
hits all of them; medians are printed. Also printed: the machine's bf16/fp32 GFLOP/s for the decode
matmul shapes (per shape the fastest of the engine's kernels: oneDNN on packed weights, the
blocked kernel, AMX tiles where a bf16 weight has an AMX copy) and the share of that roofline
each engine reaches, GB/s of weights read at batch 1 and of weights and KV read at (t), each as a
share of the machine's read bandwidth (the faster of a float32 sum and a 1-row blocked matmul
over 0.5 GiB), and the bf16 engine's logprob error against HF fp32 and bf16.
With --quantization int8 an int8 engine (int8 weights x int8 activations, bf16 elsewhere) runs
first in every round beside the others, and the logprob errors (mean, p99, max over the sampled
tokens) are printed for each engine; with --quantize-lm-head its lm_head is int8 too (else the
float32 head of the other engines). With --deterministic a deterministic=True engine (the
batch-invariant kernels) runs beside each dtype's default one, and the ratios det/default per
dtype (and per repeat) are printed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import time

import torch
import transformers

from hotswap.engine import Engine
from hotswap.engine.config import ModelConfig
from hotswap.engine.layers import cpu_kernels
from hotswap.engine.models.fetch import ensure_model

TOPICS = ["the ocean", "volcanoes", "bread", "chess", "the moon", "bees", "trains", "music",
          "glaciers", "rivers", "owls", "clocks", "maps", "tea", "bridges", "deserts"]
STYLES = ["a short poem about", "three facts about", "a story opening about",
          "a simple explanation of"]


def chat_prompts(tokenizer, n: int, system: str | None = None) -> list[list[int]]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Write {STYLES[i % 4]} {TOPICS[i % 16]}, "
                                            f"variation {i}."}]
        if system:
            msgs.insert(0, {"role": "system", "content": system})
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def long_system_prompt(tokenizer, tokens: int = 1000) -> str:
    sentence = ("You are a careful assistant for a science museum; answer visitors' questions "
                "accurately, kindly and briefly, and say so when you are unsure. ")
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += sentence
    return text


def long_tail_prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    """n prompts of ~`tokens` tokens that share no prefix (each row reads its own KV)."""
    text = long_system_prompt(tokenizer, tokens - 30)
    return [tokenizer.encode(f"Visitor {i} asks about {TOPICS[i % 16]}. {text}") for i in range(n)]


# Workloads decoded on their cached prompts: a first call prefills them (not timed).
WARM = {"t"}
# Workloads rated in prompt tokens computed per second (HF not run).
PREFILL = {"p"}


def workloads(tokenizer, chosen: str) -> dict[str, tuple[list[list[int]], int, int]]:
    """name -> (distinct prompts, samples per prompt, new tokens)."""
    makers = {
        "a": lambda: (chat_prompts(tokenizer, 64), 1, 64),
        "b": lambda: (chat_prompts(tokenizer, 8), 8, 64),
        "1": lambda: (chat_prompts(tokenizer, 1), 1, 64),
        "c": lambda: (chat_prompts(tokenizer, 64, long_system_prompt(tokenizer)), 1, 32),
        "t": lambda: (long_tail_prompts(tokenizer, 4, 2000), 1, 64),
        "p": lambda: (long_tail_prompts(tokenizer, 4, 2000), 1, 1),
    }
    return {k: makers[k]() for k in chosen.split(",")}


def unique_prefix_tokens(prompts: list[list[int]]) -> int:
    """Tokens a perfect prefix cache computes: the nodes of the prompts' trie."""
    ordered = sorted(prompts)
    shared = sum(len(os.path.commonprefix([a, b])) for a, b in zip(ordered, ordered[1:]))
    return sum(len(p) for p in ordered) - shared


_ENGINE: Engine | None = None  # the engine of a worker process (one engine per process)
# Engine labels beside the dtypes: label -> (dtype, extra Engine keywords).
QUANTIZED = {"int8": ("bfloat16", {"quantization": "int8"})}


def _start_engine(path: str, dtype: str, kwargs: dict) -> None:
    global _ENGINE
    _ENGINE = Engine(path, dtype=dtype, **kwargs)


def run_hotswap(prompts: list[list[int]], n: int, new: int, logprobs: bool = False,
                warm: bool = False) -> dict:
    """One workload through this worker's engine, from an empty prefix cache (with `warm`,
    from one holding the prompts: only their decode is timed)."""
    engine = _ENGINE
    engine.flush_cache()
    if warm:
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1})
    before = dict(engine.scheduler.stats)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, return_logprob=logprobs, sampling_params={
        "max_new_tokens": new, "n": n, "temperature": 1.0, "ignore_eos": True, "seed": 7})
    elapsed = time.perf_counter() - start
    after = engine.scheduler.stats
    tokens = sum(len(o["output_ids"]) for o in outs)
    computed = after["prefill_tokens"] - before["prefill_tokens"]
    result = {"tok_s": tokens / elapsed, "seconds": elapsed, "tokens": tokens,
              "prefill_tok_s": computed / elapsed, "prefill_computed": computed,
              "prompt_submitted": after["prompt_tokens"] - before["prompt_tokens"],
              "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if logprobs:
        result["samples"] = [(o["output_ids"], [lp for lp, _ in
                                                o["meta_info"]["output_token_logprobs"]])
                             for o in outs]
    return result


def hf_logprobs(path: str, prompts: list[list[int]], samples: list[tuple[list[int], list[float]]],
                dtype: str) -> list[float]:
    """HF's log-softmax of each sampled token, teacher-forced, in `dtype`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype)).eval()
    out = []
    with torch.no_grad():
        for prompt, (ids, _) in zip(prompts, samples):
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
            lp = logits.float().log_softmax(-1)
            out += lp.gather(1, torch.tensor(ids)[:, None]).squeeze(1).tolist()
    return out


def run_hf(path: str, prompts: list[list[int]], n: int, new: int, pad_id: int) -> dict:
    """HF generate with static batching and left padding (runs in its own process)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                             temperature=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new,
                             num_return_sequences=n, pad_token_id=pad_id, eos_token_id=None)
    elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - width) * out.shape[0]
    return {"tok_s": tokens / elapsed, "seconds": elapsed, "tokens": tokens}


def matmul_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """name -> (in features, out features, count per token) of every decode matmul."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    n = cfg.num_layers
    return {"qkv": (h, q + 2 * kv, n), "o": (q, h, n), "gate_up": (h, 2 * inter, n),
            "down": (inter, h, n), "lm_head": (h, cfg.vocab_size, 1)}


def _median_s(repeats: int, fn, *args, **kwargs) -> float:
    """Median seconds of fn(*args, **kwargs) over `repeats` calls after 3 warm-up calls."""
    samples = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        fn(*args, **kwargs)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[3:])


def measure_matmuls(shapes: dict[str, tuple[int, int, int]], rows: int = 64, repeats: int = 20,
                    int8: bool = False) -> dict[str, dict[str, float]]:
    """dtype -> shape -> seconds of one [rows, in] x [in, out] matmul (median) by the fastest of
    the engine's kernels for it: oneDNN on a packed weight, cpu_kernels.blocked_linear where the
    weight blocks and cpu_kernels.amx_linear where it has an AMX copy (layers/linear.py);
    "kernel" -> shape -> which was fastest. With int8, also "int8": the int8 linear of a bf16 x
    as the int8 engine runs it."""
    from hotswap.engine.layers.linear import amx_packs, blocks_by_default, linear, pack
    from hotswap.engine.layers.quant import int8_linear, quantize_weight

    out: dict[str, dict] = {"kernel": {}}
    for dtype in (torch.bfloat16, torch.float32):
        times, kernels = {}, {}
        for name, (k, n, _) in shapes.items():
            x, w = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype) * 0.05
            times[name], kernels[name] = _median_s(repeats, linear, x, w, packed=pack(w)), "o"
            if blocks_by_default(w, pad=name == "lm_head"):
                blocked = _median_s(repeats, cpu_kernels.blocked_linear, x,
                                    cpu_kernels.block_pack(w))
                if blocked < times[name]:
                    times[name], kernels[name] = blocked, "b"
            if name != "lm_head" and amx_packs(w):
                amx = _median_s(repeats, cpu_kernels.amx_linear, x, cpu_kernels.amx_pack(w))
                if amx < times[name]:
                    times[name], kernels[name] = amx, "a"
        dt = str(dtype).removeprefix("torch.")
        out[dt], out["kernel"][dt] = times, kernels
    if int8:
        times = {}
        for name, (k, n, _) in shapes.items():
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            qw = quantize_weight(torch.randn(n, k) * 0.05)
            times[name] = _median_s(repeats, int8_linear, x, qw)
        out["int8"] = times
    if cpu_kernels.available() and cpu_kernels.amx():
        # The float32 head of a bf16 engine as the engine runs it here: AMX matmuls of an exact
        # split (cpu_kernels.head_logits), not a float32 matmul.
        k, n, _ = shapes["lm_head"]
        hidden, norm = torch.randn(rows, k).bfloat16(), torch.ones(k, dtype=torch.bfloat16)
        packed = cpu_kernels.head_pack((torch.randn(n, k) * 0.05).bfloat16())
        out["bfloat16"]["lm_head fp32"] = _median_s(
            repeats, cpu_kernels.head_logits, hidden, norm, 1e-5, packed, n)
    return out


def measure_read_bandwidth(gib: float = 0.5, repeats: int = 5) -> tuple[float, float]:
    """GB/s of streaming a buffer much larger than the caches, two ways: a float32 sum (torch
    runs it at the rate of a hand-written AVX-512 scan with prefetch; a bf16 sum, widening as it
    goes, reads a third slower) and, with the kernels built, one row times a float32 weight of
    that size in cpu_kernels.blocked_linear (the engine's batch-1 stream, 0 otherwise). The
    faster is the read bandwidth the batch-1 and long-tail rates are measured against."""
    buf = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    rates = [buf.numel() * 4 / _min_s(repeats, buf.sum) / 1e9, 0.0]
    if cpu_kernels.available():
        blocked = cpu_kernels.block_pack(buf.view(-1, 2048))
        del buf
        x = torch.randn(1, 2048)
        rates[1] = blocked.numel() * 4 / _min_s(repeats, cpu_kernels.blocked_linear, x,
                                                  blocked) / 1e9
    return rates[0], rates[1]


def _min_s(repeats: int, fn, *args) -> float:
    """Fastest seconds of fn(*args) over `repeats` calls after one warm-up call."""
    fn(*args)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - start)
    return min(samples)


def roofline_tok_s(shapes: dict, times: dict[str, dict[str, float]], dtype: str,
                   fp32_head: bool, rows: int = 64, int8_head: bool = False) -> float:
    """Tokens/s if a decode step of `rows` rows did nothing but its matmuls at measured speed
    (dtype "int8": int8 layers, the head as bf16's or, with `int8_head`, int8)."""
    step = 0.0
    for name, (_, _, count) in shapes.items():
        if name == "lm_head" and int8_head:
            step += times["int8"][name]
        elif name == "lm_head" and fp32_head:
            head = times["bfloat16" if dtype == "int8" else dtype]
            step += head.get("lm_head fp32", times["float32"]["lm_head"])
        elif name == "lm_head" and dtype == "int8":
            step += times["bfloat16"][name]
        else:
            step += count * times[dtype][name]
    return rows / step


def weight_bytes(shapes: dict, dtype: str, fp32_head: bool, int8_head: bool = False) -> int:
    """Bytes of matmul weights one batch-1 decode step reads (with the CPU kernels built, the
    float32 head of a bf16 model reads the bf16 weights at a few rows, models/llama.py; dtype
    "int8": int8 layers, a bf16 head or, with `int8_head`, an int8 one)."""
    size = 1 if dtype == "int8" else torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    head = 4 if fp32_head and not cpu_kernels.available() else max(size, 2)
    head = 1 if int8_head else head
    total = 0
    for name, (k, n, count) in shapes.items():
        total += k * n * count * (head if name == "lm_head" else size)
    return total


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of K and V one token holds over every layer (what attention reads per token)."""
    size = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    return 2 * cfg.num_layers * cfg.kv_size * size


def long_tail_read_gbs(tok_s: float, prompts: list[list[int]], new: int, weights: int,
                       kv_per_token: int) -> float:
    """GB/s a decode of `prompts` (one row each, `new` tokens) reads at `tok_s`: every step the
    weights once and each row's KV at its mean context."""
    rows = len(prompts)
    context = sum(len(p) for p in prompts) / rows + new / 2
    return tok_s / rows * (weights + rows * context * kv_per_token) / 1e9


def print_matmul_rates(shapes: dict, times: dict[str, dict], bandwidth: tuple[float, float]
                       ) -> None:
    print("machine: decode matmuls, 64 rows, the fastest of oneDNN on the packed weight (o), "
          "the blocked kernel (b) and AMX tiles (a) (int8: the int8 linear, quantization of x "
          "included), GFLOP/s (int8: GOP/s):")
    for dtype, per in times.items():
        if dtype == "kernel":
            continue
        kernel = times["kernel"].get(dtype, {})
        rates = "  ".join(f"{name} {2 * 64 * k * n / per[name] / 1e9:.0f}{kernel.get(name, '')}"
                          for name, (k, n, _) in shapes.items())
        if "lm_head fp32" in per:  # float32 products, counted once
            k, n, _ = shapes["lm_head"]
            rates += f"  lm_head fp32 (AMX split) {2 * 64 * k * n / per['lm_head fp32'] / 1e9:.0f}"
        print(f"  {dtype:<9}{rates}")
    print(f"machine: read bandwidth {max(bandwidth):.1f} GB/s, the faster over 0.5 GiB of a "
          f"float32 sum ({bandwidth[0]:.1f}) and a 1-row blocked matmul ({bandwidth[1]:.1f})")


def logprob_errors(engine_pool, hf_pool, path: str, tokenizer) -> str:
    """Mean/p99/max |logprob - HF| over 256 tokens the engine sampled (4 prompts x 64)."""
    prompts = chat_prompts(tokenizer, 4)
    res = engine_pool.apply(run_hotswap, (prompts, 1, 64, True))
    ours = [lp for _, lps in res["samples"] for lp in lps]
    parts = []
    for ref_dtype in ("float32", "bfloat16"):
        ref = hf_pool.apply(hf_logprobs, (path, prompts, res["samples"], ref_dtype))
        diff = torch.tensor(ours) - torch.tensor(ref)
        err = diff.abs()
        parts.append(f"vs HF {ref_dtype}: mean {err.mean():.4f} p99 {err.quantile(0.99):.4f} "
                     f"max {err.max():.4f}")
    return f"{len(ours)} tokens, " + "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="bfloat16,float32",
                        help="comma list of engine dtypes, each engine in its own process")
    parser.add_argument("--workloads", default="a,b,1")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--no-pack-weights", action="store_true")
    parser.add_argument("--no-fp32-lm-head", action="store_true")
    parser.add_argument("--no-roofline", action="store_true")
    parser.add_argument("--no-logprob-check", action="store_true")
    parser.add_argument("--quantization", choices=sorted(QUANTIZED), default=None,
                        help="also run a quantized engine (first in every round)")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="the quantized engine's lm_head int8 too")
    parser.add_argument("--deterministic", action="store_true",
                        help="also run a deterministic=True engine beside each dtype's")
    args = parser.parse_args()
    path = ensure_model(args.model_path)
    # Engine labels: the quantized engine, then one per dtype (each followed by its
    # deterministic twin with --deterministic).
    dtypes = [args.quantization] if args.quantization else []
    for dt in args.dtype.split(","):
        dtypes += [dt, f"det-{dt}"] if args.deterministic else [dt]
    cfg = ModelConfig.from_path(path)
    shapes = matmul_shapes(cfg)
    ctx = mp.get_context("spawn")
    # Every side in its own process: two OpenMP teams in one process slow each other down (see
    # README, "OpenMP and threads"), which would bias the comparison.
    if not args.no_roofline:
        with ctx.Pool(1) as pool:
            times = pool.apply(measure_matmuls, (shapes,), {"int8": bool(args.quantization)})
            bandwidth = pool.apply(measure_read_bandwidth)
        print_matmul_rates(shapes, times, bandwidth)

    def of_bandwidth(gbs: float) -> str:
        return "" if args.no_roofline else f" ({gbs / max(bandwidth):.0%} of read bandwidth)"

    kwargs = {"pack_weights": not args.no_pack_weights,
              "fp32_lm_head": not args.no_fp32_lm_head}
    specs = {dt: QUANTIZED.get(dt) or ((dt[4:], {"deterministic": True})
                                       if dt.startswith("det-") else (dt, {}))
             for dt in dtypes}
    if args.quantization and args.quantize_lm_head:
        base, options = specs[args.quantization]
        specs[args.quantization] = (base, {**options, "quantize_lm_head": True})
    engines = {dt: ctx.Pool(1, initializer=_start_engine,
                            initargs=(path, specs[dt][0], {**kwargs, **specs[dt][1]}))
               for dt in dtypes}
    hf_pool = None if args.skip_hf else ctx.Pool(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    print(f"torch threads: {torch.get_num_threads()}, model: {path}, engines: {dtypes}")
    head = "".join(f"{'hotswap ' + dt:>18}" for dt in dtypes)
    print(f"{'workload':<9}{head}{'HF fp32':>10}  ratios; roofline share (a,b) / GB/s read (1, t)")
    for name, (prompts, n, new) in workloads(tokenizer, args.workloads).items():
        ours: dict[str, list[dict]] = {dt: [] for dt in dtypes}
        theirs = []
        rate = "prefill_tok_s" if name in PREFILL else "tok_s"
        for _ in range(args.repeats):  # alternate: a slow period of the machine hits every side
            for dt in dtypes:
                ours[dt].append(engines[dt].apply(run_hotswap, (prompts, n, new),
                                                  {"warm": name in WARM}))
            if hf_pool is not None and name not in WARM | PREFILL:
                theirs.append(hf_pool.apply(run_hf, (path, prompts, n, new, pad))["tok_s"])
        med = {dt: statistics.median(r[rate] for r in ours[dt]) for dt in dtypes}
        hf_med = statistics.median(theirs) if theirs else float("nan")
        notes = [f"{dt}/HF {med[dt] / hf_med:.2f}x" for dt in dtypes]
        if "bfloat16" in med and "float32" in med:
            notes.insert(0, f"bf16/fp32 {med['bfloat16'] / med['float32']:.2f}x")
        if "int8" in med and "bfloat16" in med:
            notes.insert(0, f"int8/bf16 {med['int8'] / med['bfloat16']:.2f}x")
        notes[:0] = [f"{dt}/{dt[4:]} {med[dt] / med[dt[4:]]:.2f}x"
                     for dt in dtypes if dt.startswith("det-")]
        for dt in (d for d in dtypes if not d.startswith("det-")):
            head32 = kwargs["fp32_lm_head"] and dt != "float32"
            head8 = specs[dt][1].get("quantize_lm_head", False)
            if name == "1":
                gbs = med[dt] * weight_bytes(shapes, dt, head32, head8) / 1e9
                notes.append(f"{dt} {gbs:.1f} GB/s{of_bandwidth(gbs)}")
            elif name == "t" and dt in ("bfloat16", "float32"):
                gbs = long_tail_read_gbs(med[dt], prompts, new, weight_bytes(
                    shapes, dt, head32), kv_bytes_per_token(cfg, dt))
                notes.append(f"{dt} {gbs:.1f} GB/s{of_bandwidth(gbs)}")
            elif not args.no_roofline and name in ("a", "b"):
                roof = roofline_tok_s(shapes, times, dt, head32, int8_head=head8)
                notes.append(f"{dt} {med[dt] / roof:.0%} of {roof:.0f}")
        cols = "".join(f"{med[dt]:>18.1f}" for dt in dtypes)
        print(f"{name:<9}{cols}{hf_med:>10.1f}  {'; '.join(notes)}", flush=True)
        if args.repeats > 1:  # every run, and each repeat's own ratios (robust to slow periods)
            runs = {dt: [r[rate] for r in ours[dt]] for dt in dtypes} | {"HF": theirs}
            print(f"{'':<9}runs: " + "; ".join(
                f"{k} [{', '.join(f'{v:.0f}' for v in vals)}]" for k, vals in runs.items()))
            pairs = [("bfloat16", "float32"), ("int8", "bfloat16")]
            pairs += [(dt, dt[4:]) for dt in dtypes if dt.startswith("det-")]
            for a, b in pairs:
                if a in runs and b in runs:
                    ratios = [x / y for x, y in zip(runs[a], runs[b], strict=True)]
                    print(f"{'':<9}{a}/{b} per repeat: "
                          f"{', '.join(f'{x:.2f}x' for x in ratios)}")
        r = ours[dtypes[0]][0]
        print(f"{'':<9}prefill computed / submitted {r['prefill_computed']} / "
              f"{r['prompt_submitted']} (trie-unique {unique_prefix_tokens(prompts)})")
    if hf_pool is not None and not args.no_logprob_check:
        for dt in dtypes:
            print(f"logprobs, hotswap {dt}: "
                  f"{logprob_errors(engines[dt], hf_pool, path, tokenizer)}", flush=True)
    for dt, pool in engines.items():
        rss = pool.apply(run_hotswap, ([[1, 2, 3]], 1, 1))["rss_mib"]
        print(f"peak RSS, hotswap {dt} process: {rss:.0f} MiB")
        pool.close()
    if hf_pool is not None:
        hf_pool.close()


if __name__ == "__main__":
    main()
