"""Weight transport: named process groups, flat buckets, a trainer-side sender and an engine-side
receiver, and the one order of weight-version labels (versions.py) that every layer uses.
Transport only: it never imports the engine."""

from hotswap.weight_sync.bucket import (
    Bucket,
    TensorSpec,
    dtype_to_str,
    flatten,
    make_specs,
    plan_buckets,
    str_to_dtype,
    unflatten,
)
from hotswap.weight_sync.delta import Delta, DeltaTracker, receive_delta, update_in_process
from hotswap.weight_sync.group import (
    DEFAULT_TIMEOUT_S,
    WeightGroup,
    WeightSyncError,
    destroy_group,
    get_group,
    init_process_group,
    resolve_backend,
)
from hotswap.weight_sync.receiver import (
    LOAD_FORMATS,
    check_load_format,
    discard_tensors,
    receive_tensors,
)
from hotswap.weight_sync.sender import WeightSender
from hotswap.weight_sync.versions import VersionOrder, newest, next_version, version_key

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LOAD_FORMATS",
    "Bucket",
    "Delta",
    "DeltaTracker",
    "TensorSpec",
    "VersionOrder",
    "WeightGroup",
    "WeightSender",
    "WeightSyncError",
    "check_load_format",
    "destroy_group",
    "discard_tensors",
    "dtype_to_str",
    "flatten",
    "get_group",
    "init_process_group",
    "make_specs",
    "newest",
    "next_version",
    "plan_buckets",
    "receive_delta",
    "receive_tensors",
    "resolve_backend",
    "str_to_dtype",
    "unflatten",
    "update_in_process",
    "version_key",
]
