"""Compile hotswap's Triton attention kernels ahead of time for a GPU architecture (no GPU needed).

Run as a script (the kernels must be imported without TRITON_INTERPRET, so tests start it in a
subprocess): `python triton_aot.py '[{"kernel": "extend", "arch": 89, "dtype": "float32",
"head_dim": 128, "group": 3}]'` prints, per job, the launch configuration the backend would use on
that architecture and what the compiled kernel needs: shared memory (Triton's metadata), registers
per thread and local (spill) bytes (cuobjdump -res-usage on the cubin, shipped with triton).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

KERNELS = ("decode_split", "decode_reduce", "extend")
POINTERS = {
    "decode_split": {"Q": "kv", "K_buf": "kv", "V_buf": "kv", "req_to_token": "i64",
                     "q_rows": "i32", "req_idx": "i64", "seq_lens": "i32", "Mid_O": "fp32",
                     "Mid_LSE": "fp32"},
    "decode_reduce": {"Mid_O": "fp32", "Mid_LSE": "fp32", "Out": "kv", "q_rows": "i32"},
    "extend": {"Q": "kv", "K_buf": "kv", "V_buf": "kv", "Out": "kv", "req_to_token": "i64",
               "tile_row": "i32", "tile_block": "i32", "q_starts": "i32", "prefix_lens": "i32",
               "extend_lens": "i32", "req_idx": "i64"},
}
TRITON_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
MAX_SPLITS_BLOCK = 16  # TritonAttnBackend.max_kv_splits, as the reduce's BLOCK_S


def compile_job(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hotswap.engine.attention import triton_kernels as kernels
    from hotswap.engine.attention.triton_launch import (
        SHARED_MEMORY_PER_BLOCK,
        LaunchConfig,
        gpu_launch_config,
    )

    dtype = getattr(torch, job["dtype"])
    cfg = (LaunchConfig(*job["config"]) if job.get("config") else
           gpu_launch_config(dtype, job["head_dim"], job["group"],
                             SHARED_MEMORY_PER_BLOCK[job["arch"]]))
    fn = getattr(kernels, f"{job['kernel']}_kernel")
    kv = TRITON_TYPES[job["dtype"]]
    pointers = {name: "*" + (kv if t == "kv" else t) for name, t in POINTERS[job["kernel"]].items()}
    constexprs = {"HEAD_DIM": job["head_dim"], "BLOCK_D": cfg.block_d}
    if job["kernel"] == "decode_reduce":
        constexprs["BLOCK_S"] = MAX_SPLITS_BLOCK
    else:
        constexprs.update(GROUP=job["group"], BLOCK_N=cfg.block_n, UPCAST=False,
                          PRECISION="ieee" if dtype == torch.float32 else None)
        constexprs.update({"BLOCK_H": cfg.block_h} if job["kernel"] == "decode_split"
                          else {"BLOCK_M": cfg.block_m})
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "fp32" if name == "qk_scale" else "i32")
    options = {"num_warps": cfg.num_warps}
    if job["kernel"] != "decode_reduce":
        options["num_stages"] = cfg.num_stages
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs),
                              target=GPUTarget("cuda", job["arch"], 32), options=options)
    usage = _resource_usage(compiled.asm["cubin"], triton.__file__)
    return {**job, "config": list(cfg), "shared": compiled.metadata.shared,
            "threads": 32 * cfg.num_warps, **usage}


def _resource_usage(cubin: bytes, triton_file: str) -> dict[str, int]:
    tool = os.path.join(os.path.dirname(triton_file), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    regs, stack, local = map(int, found.groups())
    return {"regs": regs, "stack": stack, "local": local}


def main(argv: list[str]) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    jobs = json.loads(argv[1])
    for job in jobs:  # one line per job, so a caller sees progress and partial results
        print(json.dumps(compile_job(job)), flush=True)


if __name__ == "__main__":
    main(sys.argv)
