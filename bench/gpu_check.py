"""One prepared GPU check (`make gpu-check`): unattended, on a CUDA machine, in under 8 minutes.

python bench/gpu_check.py [--out gpu_check.json] [--stages tests,throughput,weight-sync]
                          [--backends torch,triton,flashinfer] [--model-path P] [--dry-run]

Stages, in this order, each in its own process with its output streamed as it runs:
- tests: the gpu-marked tests (pytest -m gpu); attention-tests: tests/engine/attention, whose
  Triton tests then run compiled at the GPU's own tile sizes;
- throughput-<backend>: hotswap in bf16 on SmolLM2-135M with that attention backend, tok/s at
  batch 64 (64 prompts x 64 new tokens), GRPO 8x8 and batch 1; then throughput-hf, HF generate
  in bf16 on the same GPU, the same prompts, in the same run, and the ratios;
- weight-sync: a second process pushes the weights into an engine over NCCL (WeightSender), timed
  against a raw NCCL broadcast of the same bytes between the same two processes. NCCL refuses two
  ranks on one GPU, so this stage needs two GPUs and is skipped, saying so, with one.
Every stage's result lands in one JSON file, rewritten after each stage; the first failing stage
stops the run, and its command is printed so it can be rerun by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

BACKENDS = ("torch", "triton", "flashinfer")
STAGES = ("tests", "throughput", "weight-sync")
BUDGET_S = 8 * 60
WORKLOADS = {"batch64": (64, 1, 64), "grpo8x8": (8, 8, 64), "batch1": (1, 1, 64)}
HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    skip: str | None = None  # why this stage cannot run here (recorded, not a failure)


@dataclass
class StageResult:
    name: str
    command: str
    status: str  # "ok" | "failed" | "skipped"
    seconds: float = 0.0
    returncode: int | None = None
    result: dict[str, Any] = field(default_factory=dict)  # what the stage's worker measured
    tail: list[str] = field(default_factory=list)  # its last lines of output


def plan(args: argparse.Namespace, gpus: int) -> list[Stage]:
    """The stages to run, in order, each a command line of this interpreter."""
    me = [sys.executable, os.path.abspath(__file__)]
    model = ["--model-path", args.model_path] if args.model_path else []
    stages = []
    if "tests" in args.stages:
        pytest = [sys.executable, "-m", "pytest", "-q", "-x"]
        stages.append(Stage("tests", pytest + ["-m", "gpu"], 100))
        # compiled Triton at GPU sizes, the real flashinfer beside its fakes, the AOT check
        stages.append(Stage("attention-tests", pytest + ["tests/engine/attention"], 80))
    if "throughput" in args.stages:
        for backend in args.backends:
            stages.append(Stage(f"throughput-{backend}",
                                me + ["--worker", "throughput", "--backend", backend] + model, 60))
        stages.append(Stage("throughput-hf", me + ["--worker", "hf"] + model, 50))
    if "weight-sync" in args.stages:
        skip = None if gpus >= 2 else (f"needs 2 GPUs, found {gpus}: NCCL refuses two ranks "
                                       "on one GPU")
        stages.append(Stage("weight-sync", me + ["--worker", "weight-sync"] + model, 70, skip))
    return stages


def run_command(stage: Stage, result_path: str) -> tuple[int, list[str]]:
    """Runs the stage, echoing its output line by line; 124 when it overruns its timeout."""
    env = dict(os.environ, HOTSWAP_GPU_CHECK_RESULT=result_path)
    proc = subprocess.Popen(stage.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    tail: deque[str] = deque(maxlen=40)
    deadline = time.monotonic() + stage.timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"  [{stage.name}] {line}", end="", flush=True)
        tail.append(line.rstrip("\n"))
        if time.monotonic() > deadline:
            proc.kill()
            break
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = 124
    return (124 if time.monotonic() > deadline else rc), list(tail)


def run_stages(stages: list[Stage], out_path: str,
               runner: Callable[[Stage, str], tuple[int, list[str]]] = run_command) -> dict:
    """Runs the stages in order, writing the report after each; stops at the first failure."""
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages": [],
                              "failed": None, "env": environment()}
    result_path = out_path + ".stage.json"
    for stage in stages:
        command = shlex.join(stage.argv)
        if stage.skip:
            print(f"== {stage.name}: skipped ({stage.skip})", flush=True)
            report["stages"].append(asdict(StageResult(stage.name, command, "skipped",
                                                       result={"reason": stage.skip})))
            write_json(out_path, report)
            continue
        print(f"== {stage.name}: {command}", flush=True)
        if os.path.exists(result_path):
            os.remove(result_path)
        start = time.perf_counter()
        rc, tail = runner(stage, result_path)
        done = StageResult(stage.name, command, "ok" if rc == 0 else "failed",
                           round(time.perf_counter() - start, 1), rc, read_json(result_path),
                           tail)
        report["stages"].append(asdict(done))
        print(f"== {stage.name}: {done.status} in {done.seconds:.0f} s "
              f"{json.dumps(done.result) if done.result else ''}", flush=True)
        if rc != 0:
            report["failed"] = {"stage": stage.name, "command": command, "returncode": rc}
            write_json(out_path, report)
            print(f"STOPPED: stage {stage.name} failed (exit {rc}); rerun with:\n  {command}",
                  flush=True)
            return report
        write_json(out_path, report)
    report["ratios"] = throughput_ratios(report)
    write_json(out_path, report)
    return report


def throughput_ratios(report: dict) -> dict[str, dict[str, float]]:
    """Each backend's tok/s over HF generate's, per workload, where both ran."""
    results = {s["name"]: s["result"] for s in report["stages"] if s["status"] == "ok"}
    hf = results.get("throughput-hf", {})
    ratios = {}
    for name, res in results.items():
        if name.startswith("throughput-") and name != "throughput-hf":
            ratios[name] = {w: round(res[w] / hf[w], 2) for w in WORKLOADS
                            if res.get(w) and hf.get(w)}
    return ratios


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    for name in ("triton", "flashinfer"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    return env


def write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def report_result(result: dict) -> None:
    """A worker's measurements, for the orchestrator (and printed for whoever watches)."""
    print(json.dumps(result), flush=True)
    path = os.environ.get("HOTSWAP_GPU_CHECK_RESULT")
    if path:
        write_json(path, result)


# Workers: each runs in its own process, started by a stage.

def prompts(path: str, count: int) -> list[list[int]]:
    import transformers

    sys.path.insert(0, HERE)
    from throughput import chat_prompts

    return chat_prompts(transformers.AutoTokenizer.from_pretrained(path), count)


def worker_throughput(path: str, backend: str) -> None:
    from hotswap.engine import Engine

    engine = Engine(path, dtype="bfloat16", device="cuda", attention_backend=backend)
    params = {"temperature": 1.0, "ignore_eos": True, "seed": 7}
    engine.generate(input_ids=prompts(path, 4), sampling_params={**params, "max_new_tokens": 8})
    result: dict[str, Any] = {"backend": engine.config.attention_backend}
    for name, (count, n, new) in WORKLOADS.items():
        engine.flush_cache()
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts(path, count),
                               sampling_params={**params, "max_new_tokens": new, "n": n})
        result[name] = round(sum(len(o["output_ids"]) for o in outs) /
                             (time.perf_counter() - start), 1)
    engine.shutdown()
    report_result(result)


def worker_hf(path: str) -> None:
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    result: dict[str, Any] = {}
    for name, (count, n, new) in [("warmup", (2, 1, 4))] + list(WORKLOADS.items()):
        batch = prompts(path, count)
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device="cuda")
        mask = (torch.arange(width, device="cuda")[None, :] >=
                torch.tensor([width - len(p) for p in batch], device="cuda")[:, None]).long()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=1.0, top_k=0, max_new_tokens=new,
                                 min_new_tokens=new, num_return_sequences=n, pad_token_id=pad,
                                 eos_token_id=None)
        torch.cuda.synchronize()
        if name != "warmup":
            result[name] = round((out.shape[1] - width) * out.shape[0] /
                                 (time.perf_counter() - start), 1)
    report_result(result)


def worker_weight_sync(path: str) -> None:
    """This process: the engine on cuda:0; a spawned trainer on cuda:1 sends to it."""
    import multiprocessing as mp

    import torch

    from hotswap.engine import Engine
    from hotswap.weight_sync.group import free_port, init_process_group
    from hotswap.weight_sync.rpc import RpcServer

    engine = Engine(path, dtype="bfloat16", device="cuda")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    raw_port = free_port()
    with RpcServer(engine) as server:
        trainer = ctx.Process(target=_trainer, args=(
            path, server.address, server.authkey, free_port(), raw_port, child))
        trainer.start()
        updates, nbytes = parent.recv()  # the trainer's update times, then the raw broadcast
        group = init_process_group("127.0.0.1", raw_port, 1, 2, "raw", backend="nccl",
                                   device=torch.device("cuda", 0))
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        raw = []
        for _ in range(len(updates)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            group.broadcast(buf)
            torch.cuda.synchronize()
            raw.append(time.perf_counter() - start)
        group.destroy()
        trainer.join(60)
    engine.shutdown()
    update_s, raw_s = statistics.median(updates), statistics.median(raw)
    report_result({"bytes": nbytes, "update_s": round(update_s, 4), "raw_nccl_s": round(raw_s, 4),
                   "update_over_raw": round(update_s / raw_s, 2)})


def _trainer(path: str, address: tuple[str, int], authkey: bytes, port: int, raw_port: int,
             conn: Any) -> None:
    import safetensors.torch
    import torch

    from hotswap.weight_sync import WeightSender
    from hotswap.weight_sync.group import init_process_group
    from hotswap.weight_sync.rpc import EngineProxy

    torch.cuda.set_device(1)
    tensors = safetensors.torch.load_file(os.path.join(path, "model.safetensors"), device="cuda:1")
    tensors = {k: (v.to(torch.bfloat16) * 1.001) for k, v in tensors.items()}
    target = EngineProxy(address, authkey)
    sender = WeightSender("127.0.0.1", port, 2, backend="nccl")
    sender.connect([target], device="cuda:1")
    sender.send(list(tensors.items()), [target])  # warm-up: buffers and the NCCL channels
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        sender.send(list(tensors.items()), [target])
        times.append(time.perf_counter() - start)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    conn.send((times, nbytes))
    group = init_process_group("127.0.0.1", raw_port, 0, 2, "raw", backend="nccl",
                               device=torch.device("cuda", 1))
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    for _ in times:
        group.broadcast(flat)
    torch.cuda.synchronize()
    group.destroy()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--stages", default=",".join(STAGES), type=_choices(STAGES))
    parser.add_argument("--backends", default=",".join(BACKENDS), type=_choices(BACKENDS))
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dry-run", action="store_true", help="print the stages, run nothing")
    parser.add_argument("--worker", choices=("throughput", "hf", "weight-sync"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        chosen = [x for x in text.split(",") if x]
        bad = [x for x in chosen if x not in allowed]
        if bad or not chosen:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {','.join(allowed)}")
        return chosen
    return parse


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from hotswap.engine.models.fetch import ensure_model

        path = ensure_model(args.model_path)
        {"throughput": lambda: worker_throughput(path, args.backend),
         "hf": lambda: worker_hf(path), "weight-sync": lambda: worker_weight_sync(path)
         }[args.worker]()
        return 0
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    stages = plan(args, gpus)
    if args.dry_run:
        for stage in stages:
            print(f"{stage.name}: {shlex.join(stage.argv)}" +
                  (f"  (skipped: {stage.skip})" if stage.skip else ""))
        return 0
    if not gpus:
        print("gpu-check needs CUDA: torch.cuda.is_available() is False here", file=sys.stderr)
        return 2
    assert sum(s.timeout_s for s in stages if not s.skip) <= BUDGET_S
    report = run_stages(stages, args.out)
    print(f"wrote {args.out}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
