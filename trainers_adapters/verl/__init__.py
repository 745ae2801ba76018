"""hotswap as verl's rollout: `actor_rollout_ref.rollout.name=hotswap` (verl 0.9.1).

verl imports this package through its plugin mechanism: the `verl.plugins` entry point that
`pip install hotswap` declares (verl loads every entry point of that group at `import verl`,
unless VERL_USE_EXTERNAL_PLUGINS=none), or `VERL_USE_EXTERNAL_MODULES=
hotswap.trainers_adapters.verl`. `register()` then adds, without changing anything of verl:
- "hotswap" to `RolloutReplicaRegistry` (replica.py: the replica and its server actor, server.py);
- ("hotswap", "async") to the `BaseRollout` registry (rollout.py: the training worker's side,
  which pushes weights to the server actors, one version per step, all or none);
- "cpu" to `PlatformRegistry` (platform.py), chosen with VERL_PLATFORM=cpu.
Without verl installed, importing this package registers nothing and the modules that do not
subclass verl's classes (server.py, rollout.py) still work. docs/rl.md#hotswap-in-verl.
"""

from __future__ import annotations

import importlib.util

ROLLOUT_NAME = "hotswap"
ROLLOUT_CLASS = "hotswap.trainers_adapters.verl.rollout.HotswapRollout"


def _load_replica() -> type:
    from hotswap.trainers_adapters.verl.replica import HotswapReplica

    return HotswapReplica


def register() -> bool:
    """Registers hotswap's rollout and the CPU platform with verl; False without verl."""
    if importlib.util.find_spec("verl") is None:
        return False
    import verl  # noqa: F401  (first: `import verl` loads its plugins, maybe this package's)

    from hotswap.trainers_adapters.verl import platform

    platform.register()  # before verl modules that ask for the platform when they load
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ROLLOUT_CLASS
    return True


register()
