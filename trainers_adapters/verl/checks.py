"""verl's sync PPO trainer with hotswap's checks logged as metrics: `trainer.v1.trainer_mode=
hotswap_checked` (with `VERL_USE_EXTERNAL_MODULES=hotswap.trainers_adapters.verl.checks`).

It is verl 0.9.1's `PPOTrainerSync` unchanged (trainer/ppo/v1/trainer_sync.py), plus metrics
read from what verl already computed and stored, so a run shows that hotswap served it right:
- `hotswap/logprob_abs_diff_mean|max`: |rollout log-prob - verl actor's log-prob| over the
  response tokens, after verl's actor recomputed them (teacher-forced, before the update);
- `hotswap/token_version_min|max` and `hotswap/tokens_off_version`: the hotswap weight version
  of every generated token, against the version verl pushed before the rollout (its global step
  minus one);
- `hotswap/weight_version_after_push`: every replica's version after the step's push (the step).
examples/verl/grpo_cpu.py --check asserts them.
"""

from __future__ import annotations

from typing import Any

import torch

from hotswap.trainers_adapters.verl import platform

# verl may import this module while `import verl` runs, before the package's register() has
# finished; verl's trainer modules ask for the platform when they load.
platform.register()

import transfer_queue as tq  # noqa: E402
from verl.trainer.ppo.v1.trainer_base import register_trainer  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402

TRAINER_MODE = "hotswap_checked"


@register_trainer(TRAINER_MODE)
class CheckedSyncTrainer(PPOTrainerSync):
    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        batch = super()._compute_old_log_prob(batch, metrics)
        keep = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        data = tq.kv_batch_get(keys=[batch.keys[i] for i in keep], partition_id=batch.partition_id,
                               select_fields=["old_log_probs", "rollout_log_probs",
                                              "response_mask", "extra_fields"])
        extra = data.pop("extra_fields").tolist()
        padded = data.to_padded_tensor()
        mask = padded["response_mask"].bool()
        diff = (padded["old_log_probs"] - padded["rollout_log_probs"]).abs()[mask]
        metrics.update(version_metrics(extra, expected=str(self.global_steps - 1)))
        metrics["hotswap/logprob_abs_diff_mean"] = diff.mean().item()
        metrics["hotswap/logprob_abs_diff_max"] = diff.max().item()
        return batch

    def on_step_end(self) -> None:
        import ray

        super().on_step_end()
        servers = [r.servers[0] for r in self.llm_server_manager.get_replicas()]
        versions = {int(v) for v in ray.get([s.get_weight_version.remote() for s in servers])}
        pending = getattr(self, "_pending_sync_metrics", None) or {}
        self._pending_sync_metrics = {**pending, "hotswap/weight_version_after_push": max(versions),
                                      "hotswap/replica_versions_differ": int(len(versions) > 1)}


def version_metrics(extra_fields: list[dict], expected: str) -> dict[str, float]:
    """Per-token weight versions of a batch (server.py puts them in extra_fields)."""
    versions = [v for fields in extra_fields for v in fields["hotswap_weight_versions"]]
    steps = torch.tensor([int(v) for v in versions], dtype=torch.int64)
    return {"hotswap/token_version_min": steps.min().item(),
            "hotswap/token_version_max": steps.max().item(),
            "hotswap/tokens_off_version": sum(v != expected for v in versions),
            "hotswap/generated_tokens": len(versions)}
