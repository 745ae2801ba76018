"""verl's `RolloutReplica` for hotswap: starts one HotswapServer actor per replica (verl 0.9.1).

Follows verl 0.9.1 workers/rollout/replica.py (`RolloutReplica`, `RolloutReplicaRegistry`) and
its SGLang replica (async_sglang_server.py `SGLangReplica.launch_servers`). verl's
LLMServerManager makes one replica per `tensor_model_parallel_size` training ranks and calls
`init_hybrid(worker_group)` (or `init_colocated` / `init_standalone`); `launch_servers` then
starts the server actor in the placement group of the replica's first worker (on its node, with
its devices), named `hotswap_server_{replica_rank}_0` so that the training ranks' adapter
(rollout.py) finds it. Engine options come from the rollout config (dtype, tensor parallel size,
max_num_seqs, prefix caching, seed, max_model_len, logprobs_mode) and, last,
`rollout.engine_kwargs.hotswap` (any `hotswap.engine.Engine` keyword).

Refused, with the reason: a replica over several nodes, data or pipeline parallel replicas (use
more replicas), logprobs modes other than processed or raw logprobs.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import get_visible_devices_keyword
from verl.workers.config import HFModelConfig
from verl.workers.rollout.replica import RolloutReplica

from hotswap.trainers_adapters.verl.rollout import SERVER_NAME
from hotswap.trainers_adapters.verl.server import HotswapServer, ServerSettings
from hotswap.trainers_adapters.vllm import LOGPROB_MODES

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
           "float": "float32"}


class HotswapReplica(RolloutReplica):
    """One hotswap engine serving verl's agent loops (`rollout.name=hotswap`)."""

    async def launch_servers(self) -> None:
        if self.nnodes > 1:
            raise ValueError(f"a hotswap replica runs on one node; rollout world size "
                             f"{self.world_size} spans {self.nnodes} nodes of "
                             f"{self.gpus_per_node}")
        if self.config.data_parallel_size > 1 or self.config.pipeline_model_parallel_size > 1:
            raise ValueError("hotswap replicas are tensor parallel only: set rollout "
                             "data_parallel_size and pipeline_model_parallel_size to 1 (more "
                             "training ranks make more replicas)")
        import ray

        places = await asyncio.gather(*[w.__ray_call__.remote(_where) for w in self.workers])
        node_id, _, group = places[0]
        devices = sorted({d for _, dv, _ in places for d in dv.split(",") if d.strip()}, key=int)
        settings = ServerSettings(
            model_path=_local_path(self.model_config),
            engine_kwargs=engine_kwargs(self.config, self.replica_rank),
            rollout_mode=self.rollout_mode.value, replica_rank=self.replica_rank,
            free_cache_engine=self.config.free_cache_engine,
            prompt_length=self.config.prompt_length, response_length=self.config.response_length,
            logprob_mode=LOGPROB_MODES[self.config.logprobs_mode],
            http_host=ray.util.get_node_ip_address().strip("[]"),
            visible_devices=(get_visible_devices_keyword(), ",".join(devices)) if devices else None)
        server = ray.remote(HotswapServer).options(
            name=self._server_name(), max_concurrency=self.max_concurrency, num_cpus=1,
            scheduling_strategy=_strategy(node_id, group),
            runtime_env={"env_vars": _server_env()},
        ).remote(settings)
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        host, port = await server.get_server_address.remote()
        self._server_address = f"{host}:{port}"

    def _server_name(self) -> str:
        role = "_reward" if self.is_reward_model else "_teacher" if self.is_teacher_model else ""
        name = SERVER_NAME.format(replica=self.replica_rank, node=0)
        return name.replace("hotswap_server", "hotswap_server" + role) + self.name_suffix


def engine_kwargs(config: Any, replica_rank: int) -> dict[str, Any]:
    """hotswap Engine options from verl's rollout config, `engine_kwargs.hotswap` last."""
    if config.logprobs_mode not in LOGPROB_MODES:
        raise ValueError(f"logprobs_mode {config.logprobs_mode!r}: hotswap returns "
                         f"{sorted(LOGPROB_MODES)}")
    dtype = str(config.dtype)
    kwargs: dict[str, Any] = {
        "dtype": _DTYPES.get(dtype, dtype), "tp_size": config.tensor_model_parallel_size,
        "max_running_requests": config.max_num_seqs,
        "max_prefill_tokens": config.max_num_batched_tokens,
        "enable_prefix_cache": config.enable_prefix_caching,
        "seed": config.seed + replica_rank,
    }
    if config.max_model_len:
        kwargs["context_length"] = config.max_model_len
    kwargs.update((config.engine_kwargs or {}).get("hotswap") or {})
    return kwargs


def _local_path(model_config: Any) -> str:
    """The model folder: verl hands replicas its model config as given (a DictConfig)."""
    if not isinstance(model_config, HFModelConfig):
        model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
    return model_config.local_path


def _where(_: Any) -> tuple[str, str, Any]:
    """Runs inside a verl worker: its node, its devices and its placement group."""
    import ray
    from ray.util import get_current_placement_group

    return (ray.get_runtime_context().get_node_id(),
            os.environ.get(get_visible_devices_keyword(), ""), get_current_placement_group())


def _strategy(node_id: str, group: Any) -> Any:
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    if group is None:
        return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    # verl makes one placement group per node, so any bundle of it is on the worker's node
    return PlacementGroupSchedulingStrategy(placement_group=group,
                                            placement_group_bundle_index=-1)


def _server_env() -> dict[str, str]:
    from verl.plugin.platform import get_platform

    platform = get_platform()
    return {**{var: "1" for var in platform.ray_noset_envvars()}, **platform.rollout_env_vars()}
