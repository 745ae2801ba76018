"""verl's own trainer (`python -m verl.trainer.main_ppo`) running GRPO with hotswap rolling out, on
CPU: FSDP2 over gloo, SmolLM2-135M-Instruct, single-digit addition (docs/rl.md#hotswap-in-verl).

    python examples/verl/grpo_cpu.py [--steps 2] [--check] [-- extra hydra overrides]

Run it with the Python of an environment that has verl 0.9.1 and hotswap (`make test-verl`
builds one). It writes the dataset, runs main_ppo with the configuration below, prints one row
per step from verl's metrics, and with --check asserts what hotswap must deliver: every token's
weight version is the step verl pushed before the rollout, the rollout log-probs equal verl's
actor recomputing them (mean |diff| < 1e-4, fp32 on both sides), every push lands as one
version equal to verl's global step, and a reward is logged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODEL = ROOT / "models" / "smollm2-135m-instruct"
LOGPROB_TOLERANCE = 1e-4

# What a CPU run needs, each for a reason (docs/rl.md#hotswap-in-verl lists them too).
ENV = {
    "VERL_PLATFORM": "cpu",  # hotswap's CPU platform from verl's PlatformRegistry
    "VERL_ENGINE_DEVICE": "cuda",  # verl registers its FSDP engines for cuda/npu only
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray binds 127.0.0.1
    "RAY_USAGE_STATS_ENABLED": "0",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "HYDRA_FULL_ERROR": "1",
}


def overrides(data: Path, steps: int) -> list[str]:
    rollout = "actor_rollout_ref.rollout"
    actor = "actor_rollout_ref.actor"
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
        "data.train_batch_size=4", "data.max_prompt_length=64", "data.max_response_length=16",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={MODEL}",
        "actor_rollout_ref.model.use_remove_padding=False",  # needs flash-attn's varlen kernels
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{actor}.strategy=fsdp2", f"{actor}.use_kl_loss=False",
        f"{actor}.ppo_mini_batch_size=4", f"{actor}.ppo_micro_batch_size_per_gpu=8",
        f"{actor}.fsdp_config.use_torch_compile=False",
        *(f"+{actor}.fsdp_config.mixed_precision.{k}=fp32"  # fp32 actor: logprobs comparable
          for k in ("param_dtype", "reduce_dtype", "buffer_dtype")),
        f"{rollout}.name=hotswap", f"{rollout}.n=4", f"{rollout}.dtype=float32",
        f"{rollout}.tensor_model_parallel_size=1", f"{rollout}.calculate_log_probs=True",
        f"{rollout}.log_prob_micro_batch_size_per_gpu=8", f"{rollout}.agent.num_workers=1",
        f"+{rollout}.engine_kwargs.hotswap.max_total_tokens=4096",
        f"reward.custom_reward_function.path={HERE / 'reward.py'}", "reward.num_workers=1",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=False",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console,file]",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "+ray_kwargs.ray_init.num_gpus=1",  # verl sizes pools in Ray GPUs: one per training rank
        "ray_kwargs.ray_init.num_cpus=8",  # logical: the placement group bundles ask for 3 each
    ]


def run(steps: int, check: bool, extra: list[str], workdir: Path) -> list[dict]:
    data, metrics = workdir / "data", workdir / "metrics.jsonl"
    subprocess.run([sys.executable, str(HERE / "addition_data.py"), str(data)], check=True)
    env = {**os.environ, **ENV, "VERL_FILE_LOGGER_PATH": str(metrics)}
    modules = ["hotswap.trainers_adapters.verl"]
    args = overrides(data, steps)
    if check:
        modules.append("hotswap.trainers_adapters.verl.checks")
        args.append("trainer.v1.trainer_mode=hotswap_checked")
    env["VERL_USE_EXTERNAL_MODULES"] = ",".join(modules)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *args, *extra],
                          env=env, cwd=workdir)
    print(f"main_ppo exited {proc.returncode} after {time.monotonic() - start:.0f} s")
    if proc.returncode != 0:
        sys.exit(proc.returncode)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def report(rows: list[dict]) -> None:
    cols = [("reward", "critic/score/mean"), ("gen s", "timing_s/gen"),
            ("logp s", "timing_s/old_log_prob"), ("update s", "timing_s/update_actor"),
            ("push s", "timing_s/update_weights"), ("step s", "timing_s/step"),
            ("tok ver", "hotswap/token_version_max"),
            ("ver after", "hotswap/weight_version_after_push"),
            ("|dlogp| mean", "hotswap/logprob_abs_diff_mean"),
            ("|dlogp| max", "hotswap/logprob_abs_diff_max")]
    print("step " + " ".join(f"{name:>12}" for name, _ in cols))
    for row in rows:
        values = [row["data"].get(key) for _, key in cols]
        print(f"{row['step']:>4} " + " ".join(
            f"{'-':>12}" if v is None else f"{v:>12.3g}" for v in values))


def check(rows: list[dict], steps: int) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    for row in rows:
        step, m = row["step"], row["data"]
        assert m["hotswap/generated_tokens"] > 0
        assert m["hotswap/token_version_min"] == m["hotswap/token_version_max"] == step - 1, m
        assert m["hotswap/tokens_off_version"] == 0, m
        assert m["training/off_policy/trajectory_staleness/max"] == 0, m
        assert m["hotswap/weight_version_after_push"] == step, m
        assert m["hotswap/replica_versions_differ"] == 0, m
        assert m["hotswap/logprob_abs_diff_mean"] < LOGPROB_TOLERANCE, m
        assert "critic/score/mean" in m, m
    print(f"checks passed: {steps} steps; every token on the version pushed before its rollout; "
          f"rollout vs actor log-probs within {LOGPROB_TOLERANCE}; reward logged")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="assert hotswap's checks")
    parser.add_argument("--workdir", help="where data, metrics and verl's outputs go")
    parser.add_argument("extra", nargs="*", help="more hydra overrides, after --")
    args = parser.parse_args()
    if not MODEL.exists():
        sys.exit(f"{MODEL} is missing: run `make model` first")
    with tempfile.TemporaryDirectory(prefix="verl-grpo-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        rows = run(args.steps, args.check, args.extra, workdir)
        report(rows)
        if args.check:
            check(rows, args.steps)


if __name__ == "__main__":
    main()
