"""Mixture of experts: hotswap on a tiny-but-not-trivial Qwen3-MoE vs HF transformers `generate`
on it, and vs hotswap on a dense Qwen3 of equal active parameters, in one run on one machine.

python bench/moe.py [--dtype float32] [--quantization int8] [--workloads a,b,1] [--repeats 1]
                    [--skip-hf]
The MoE: 8 layers, hidden 512, 8 query / 4 KV heads of 64, 32 experts of intermediate 256, top-4
(norm_topk_prob), vocabulary 4096, random weights (std 0.05), written to a temp folder with a
word-level tokenizer. The dense twin has the same attention, norms and head and one MLP of
intermediate 4 x 256 = 1024: the same multiply-adds per token. Workloads (temperature 1, eos
ignored): (a) 64 prompts of 32 random tokens x 64 new tokens; (b) GRPO-style 8 prompts x n=8 x 64;
(1) batch 1, one prompt x 64 new tokens. Each side runs in its own process (two OpenMP teams in
one process slow each other down) and the repeats alternate between them; medians are printed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time

import torch
import transformers

from hotswap.engine import Engine

VOCAB = 4096
SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, vocab_size=VOCAB, max_position_embeddings=1024, eos_token_id=1,
             bos_token_id=0, tie_word_embeddings=False, rms_norm_eps=1e-6)
EXPERTS, TOP_K, EXPERT_INTER = 32, 4, 256


def write_tokenizer(path: str) -> None:
    """A word-level tokenizer of VOCAB made-up words: the engine loads one; prompts are ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>",
                                                pad_token="</s>")
    fast.save_pretrained(path)


def write_model(path: str, moe: bool) -> str:
    if moe:
        cfg = transformers.Qwen3MoeConfig(**SHAPE, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                          moe_intermediate_size=EXPERT_INTER,
                                          intermediate_size=TOP_K * EXPERT_INTER,
                                          norm_topk_prob=True)
    else:
        cfg = transformers.Qwen3Config(**SHAPE, intermediate_size=TOP_K * EXPERT_INTER)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def active_params(path: str) -> float:
    """Millions of weights one token multiplies (embedding lookup excluded)."""
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    h, layers, hd = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    attn = h * hd * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    if "moe_intermediate_size" in c:
        mlp = 3 * h * c["moe_intermediate_size"] * c["num_experts_per_tok"] + h * (
            c.get("num_experts") or c["num_local_experts"])
    else:
        mlp = 3 * h * c["intermediate_size"]
    return (layers * (attn + mlp) + h * c["vocab_size"]) / 1e6


def workloads(chosen: str) -> dict[str, tuple[list[list[int]], int, int]]:
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(n)]

    makers = {"a": lambda: (prompts(64), 1, 64), "b": lambda: (prompts(8), 8, 64),
              "1": lambda: (prompts(1), 1, 64)}
    return {k: makers[k]() for k in chosen.split(",")}


_ENGINE: Engine | None = None  # the engine of a worker process


def _start_engine(path: str, dtype: str, quantization: str | None) -> None:
    global _ENGINE
    _ENGINE = Engine(path, dtype=dtype, device="cpu", quantization=quantization)


def run_hotswap(prompts: list[list[int]], n: int, new: int) -> float:
    _ENGINE.flush_cache()
    start = time.perf_counter()
    outs = _ENGINE.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": new, "n": n, "temperature": 1.0, "ignore_eos": True, "seed": 7})
    return sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - start)


_HF: transformers.PreTrainedModel | None = None


def run_hf(path: str, prompts: list[list[int]], n: int, new: int) -> float:
    """HF generate, static batch (the prompts have one length: no padding)."""
    global _HF
    if _HF is None:
        _HF = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = _HF.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                           temperature=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new,
                           num_return_sequences=n, pad_token_id=1, eos_token_id=None)
    return (out.shape[1] - ids.shape[1]) * out.shape[0] / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32", help="the engines' dtype (HF: float32)")
    parser.add_argument("--quantization", choices=["int8"], default=None,
                        help="both engines int8 (the MoE's experts too; routers stay float)")
    parser.add_argument("--workloads", default="a,b,1")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="hotswap-moe-bench-")
    paths = {"moe": write_model(os.path.join(root, "moe"), moe=True),
             "dense": write_model(os.path.join(root, "dense"), moe=False)}
    print(f"models in {root}: MoE {active_params(paths['moe']):.1f}M active weights per token "
          f"({EXPERTS} experts top-{TOP_K}), dense {active_params(paths['dense']):.1f}M; "
          f"engines {args.dtype} (quantization {args.quantization}), HF float32, torch threads "
          f"{torch.get_num_threads()}")
    ctx = mp.get_context("spawn")
    pools = {name: ctx.Pool(1, initializer=_start_engine,
                            initargs=(path, args.dtype, args.quantization))
             for name, path in paths.items()}
    hf_pool = None if args.skip_hf else ctx.Pool(1)
    # Warm-up, one side at a time: every engine started and its matmul primitives built
    # before anything is timed (the pools start their engines concurrently).
    warm = workloads("a")["a"][0]
    for pool in pools.values():
        pool.apply(run_hotswap, (warm, 1, 8))
    if hf_pool is not None:
        hf_pool.apply(run_hf, (paths["moe"], warm[:8], 1, 4))
    print(f"{'workload':<9}{'MoE tok/s':>11}{'dense tok/s':>13}{'HF MoE tok/s':>14}  ratios")
    for name, (prompts, n, new) in workloads(args.workloads).items():
        runs: dict[str, list[float]] = {"moe": [], "dense": [], "hf": []}
        for _ in range(args.repeats):  # alternate: a slow period of the machine hits every side
            for side, pool in pools.items():
                runs[side].append(pool.apply(run_hotswap, (prompts, n, new)))
            if hf_pool is not None:
                runs["hf"].append(hf_pool.apply(run_hf, (paths["moe"], prompts, n, new)))
        med = {k: statistics.median(v) if v else float("nan") for k, v in runs.items()}
        print(f"{name:<9}{med['moe']:>11.1f}{med['dense']:>13.1f}{med['hf']:>14.1f}  "
              f"MoE/HF {med['moe'] / med['hf']:.2f}x; MoE cost vs dense "
              f"{med['dense'] / med['moe']:.2f}x", flush=True)
    for pool in (*pools.values(), hf_pool):
        if pool is not None:
            pool.close()


if __name__ == "__main__":
    main()
