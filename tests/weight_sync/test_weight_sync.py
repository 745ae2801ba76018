"""hotswap.weight_sync over gloo on localhost: real groups, real broadcasts, real dead peers.

Most tests run the targets in this process (gloo ranks in different threads); the dead-peer tests
use spawned processes so that one side can really be killed.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time

import hypothesis.strategies as st
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings

from hotswap.weight_sync import (
    WeightSender,
    WeightSyncError,
    destroy_group,
    discard_tensors,
    dtype_to_str,
    flatten,
    get_group,
    init_process_group,
    plan_buckets,
    receive_tensors,
    resolve_backend,
    str_to_dtype,
    unflatten,
)
from hotswap.weight_sync.bucket import TensorSpec, buckets_from_counts
from hotswap.weight_sync.group import free_port
from hotswap.weight_sync.receiver import Landing

TIMEOUT_S = 10.0
F32, BF16 = torch.float32, torch.bfloat16


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),
        "layers.0.norm.weight": torch.randn(8, generator=g).to(BF16),
        "layers.0.proj.weight": torch.randn(8, 8, generator=g).to(BF16),
        "layers.0.big.weight": torch.randn(64, 8, generator=g),
        "scale": torch.randn((), generator=g),
        "lm_head.weight": torch.randn(16, 8, generator=g),
    }


class FakeTarget:
    """An engine stand-in: parameters, a version, the engine's weight-update methods and its
    two-phase ones (prepare / commit / abort), which a sender with several targets uses.

    direct: one-phase updates receive straight into the live parameters (into=); otherwise
    stage, then commit.
    fail_after: stop consuming after that many tensors and report failure.
    exit_after: kill this process after that many tensors (only in a child process).
    """

    def __init__(self, params: dict[str, torch.Tensor], direct: bool = False) -> None:
        self.params = {name: t.clone() for name, t in params.items()}
        self.version = "v0"
        self.direct = direct
        self.fail_after: int | None = None
        self.exit_after: int | None = None
        self.rank: int | None = None
        self.received: list[str] = []
        self.prepared: dict[str, torch.Tensor] | None = None
        self.proposal = "1"  # the version prepare proposes for weight_version=None
        self.aborts = 0

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name, backend):
        init_process_group(master_address, master_port, rank_offset, world_size, group_name,
                           backend, timeout_s=TIMEOUT_S)
        self.rank = rank_offset
        return {"success": True, "message": ""}

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, weight_version,
                                        flush_cache, pause_mode, load_format):
        staged = self._receive(names, dtypes, shapes, group_name, load_format, self.direct)
        if isinstance(staged, str):
            return self._reply(False, staged)
        self._apply(staged, weight_version)
        return self._reply(True, "")

    def prepare_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format):
        staged = self._receive(names, dtypes, shapes, group_name, load_format, False)
        if isinstance(staged, str):
            return self._reply(False, staged)
        self.prepared = staged
        return {"success": True, "message": "", "weight_version": self.proposal}

    def commit_weight_update(self, weight_version=None, pause_mode=None):
        self._apply(self.prepared, weight_version)
        self.prepared = None
        return self._reply(True, "")

    def abort_weight_update(self):
        self.prepared = None
        self.aborts += 1
        return self._reply(True, "")

    def _receive(self, names, dtypes, shapes, group_name, load_format, direct):
        """The received tensors, or why the update was refused."""
        group = get_group(group_name, self.rank)
        bad = [n for n, d, s in zip(names, dtypes, shapes, strict=True)
               if n not in self.params or self.params[n].dtype != str_to_dtype(d)
               or list(self.params[n].shape) != list(s)]
        if bad:
            discard_tensors(group, names, dtypes, shapes, load_format)
            return f"mismatched: {bad}"
        into = self.params if direct else None
        staged = {}
        with contextlib.closing(receive_tensors(group, names, dtypes, shapes, load_format,
                                                into=into)) as tensors:
            for name, tensor in tensors:
                if len(staged) == self.fail_after:
                    return "failed mid-update"
                if len(staged) == self.exit_after:
                    os._exit(3)
                staged[name] = tensor if direct else tensor.clone()
        return staged

    def _apply(self, staged, weight_version):
        self.received = list(staged)
        self.params.update(staged)
        self.version = weight_version

    def destroy_weights_update_group(self, group_name):
        destroy_group(group_name, self.rank)
        return {"success": True, "message": ""}

    def _reply(self, success: bool, message: str) -> dict:
        return {"success": success, "message": message, "weight_version": self.version}


def assert_same(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in expected.items():
        assert params[name].dtype == tensor.dtype, name
        assert torch.equal(params[name], tensor), name


@pytest.fixture
def port() -> int:
    return free_port()


def test_dtype_strings_round_trip():
    for dtype in (F32, BF16, torch.float16, torch.int64):
        assert str_to_dtype(dtype_to_str(dtype)) == dtype
    assert str_to_dtype("torch.bfloat16") == BF16
    with pytest.raises(ValueError):
        str_to_dtype("float13")
    with pytest.raises(ValueError):
        dtype_to_str(torch.complex64)


def test_resolve_backend():
    assert resolve_backend("gloo") == "gloo"
    assert resolve_backend("auto", "cpu") == "gloo"
    if not torch.cuda.is_available():
        assert resolve_backend("auto") == "gloo"
    with pytest.raises(ValueError):
        resolve_backend("mpi")


def test_plan_buckets_packs_consecutive_same_dtype():
    specs = [("a", F32, (4,)), ("b", F32, (4,)), ("c", F32, (4,)), ("d", BF16, (2,)),
             ("e", F32, (100,)), ("f", F32, (1,)), ("g", F32, ())]
    buckets = plan_buckets(specs, bucket_bytes=32)
    assert [[s.name for s in b.specs] for b in buckets] == [
        ["a", "b"], ["c"], ["d"], ["e"], ["f", "g"]]
    assert buckets[3].nbytes == 400  # larger than bucket_bytes: alone
    assert plan_buckets([], 32) == []
    with pytest.raises(ValueError):
        plan_buckets(specs, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([F32, BF16]), st.lists(st.integers(0, 5), max_size=3)),
                max_size=12),
       st.integers(1, 64))
def test_plan_buckets_properties(raw, bucket_bytes):
    specs = [TensorSpec(f"t{i}", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(raw)]
    buckets = plan_buckets(specs, bucket_bytes)
    assert [s for b in buckets for s in b.specs] == specs
    for bucket in buckets:
        assert all(s.dtype == bucket.dtype for s in bucket.specs)
        assert bucket.nbytes <= bucket_bytes or len(bucket.specs) == 1
    assert buckets == plan_buckets(specs, bucket_bytes)
    counts = [len(b.specs) for b in buckets]
    assert buckets_from_counts(specs, counts) == buckets


def test_buckets_from_counts_rejects_bad_headers():
    specs = [TensorSpec("a", F32, (2,)), TensorSpec("b", BF16, (2,))]
    for counts in ([1], [3], [2], [1, 0, 1]):
        with pytest.raises(ValueError):
            buckets_from_counts(specs, counts)


def test_flatten_unflatten_round_trip_with_views():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(())]
    flat = flatten(tensors)
    specs = [TensorSpec(str(i), F32, tuple(t.shape)) for i, t in enumerate(tensors)]
    views = unflatten(flat, specs)
    for view, tensor in zip(views, tensors, strict=True):
        assert torch.equal(view, tensor)
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    single = torch.randn(6)
    assert flatten([single]).data_ptr() == single.data_ptr()
    with pytest.raises(ValueError):
        flatten([torch.randn(2), torch.randn(2).to(BF16)])
    with pytest.raises(ValueError):
        unflatten(flat[:-1], specs)


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_send_mixed_dtypes_to_two_targets(port, load_format):
    targets = [FakeTarget(make_params(0)), FakeTarget(make_params(0))]
    sender = WeightSender("127.0.0.1", port, world_size=3, group_name="g", bucket_bytes=96,
                          timeout_s=TIMEOUT_S)
    new = make_params(1)
    try:
        replies = sender.send(new, targets, weight_version="v1", load_format=load_format)
        assert [r["weight_version"] for r in replies] == ["v1", "v1"]
        for target in targets:
            assert_same(target.params, new)
            assert target.received == list(new)
        newer = make_params(2)
        sender.send(list(newer.items()), targets, weight_version="v2", load_format=load_format)
        assert all(t.version == "v2" for t in targets)
        assert_same(targets[1].params, newer)
    finally:
        sender.close(targets)


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_one_direct_target_receives_into_its_live_parameters(port, load_format):
    target = FakeTarget(make_params(0), direct=True)
    live = target.params["embed.weight"]
    sender = WeightSender("127.0.0.1", port, world_size=2, bucket_bytes=96, timeout_s=TIMEOUT_S)
    new = make_params(1)
    try:
        sender.send(new, [target], weight_version="v1", load_format=load_format)
        assert_same(target.params, new)
        if load_format is None:  # broadcast straight into the live storage
            assert target.params["embed.weight"].data_ptr() == live.data_ptr()
    finally:
        sender.close([target])


def test_rejecting_or_failing_target_leaves_every_target_on_its_version(port):
    good, bad = FakeTarget(make_params(0)), FakeTarget(make_params(0))
    bad.params["lm_head.weight"] = torch.zeros(3, 3)
    sender = WeightSender("127.0.0.1", port, 3, timeout_s=TIMEOUT_S)
    new = make_params(1)
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as info:
            sender.send(new, [good, bad], weight_version="v1")
        assert list(info.value.failures) == [f"target 1 ({bad!r})"]
        assert "lm_head.weight" in str(info.value) and "no target committed" in str(info.value)
        assert time.monotonic() - start < TIMEOUT_S / 2  # the rejecting target drained
        assert bad.version == good.version == "v0"
        assert_same(good.params, make_params(0))
        assert good.aborts == bad.aborts == 1 and good.prepared is None

        bad.params["lm_head.weight"] = torch.zeros(16, 8)
        bad.fail_after = 2
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="failed mid-update"):
            sender.send(new, [good, bad], weight_version="v2", load_format=None)
        assert time.monotonic() - start < TIMEOUT_S / 2  # closing the receive drained the rest
        assert bad.version == good.version == "v0" and sender.connected

        bad.fail_after = None
        sender.send(new, [good, bad], weight_version="v3")
        assert good.version == bad.version == "v3"
        assert_same(bad.params, new)
    finally:
        sender.close([good, bad])


def test_targets_agree_on_one_auto_version(port):
    """weight_version=None: targets whose own counters differ still commit the same version."""
    behind, ahead = FakeTarget(make_params(0)), FakeTarget(make_params(0))
    behind.proposal, ahead.proposal = "3", "12"
    sender = WeightSender("127.0.0.1", port, 3, timeout_s=TIMEOUT_S)
    try:
        replies = sender.send(make_params(1), [behind, ahead])
        assert [r["weight_version"] for r in replies] == ["12", "12"]
        assert behind.version == ahead.version == "12"
    finally:
        sender.close([behind, ahead])


def test_several_targets_without_two_phase_methods_are_refused(port):
    class OnePhase:
        init_weights_update_group = FakeTarget.init_weights_update_group
        update_weights_from_distributed = FakeTarget.update_weights_from_distributed

    sender = WeightSender("127.0.0.1", port, 3, timeout_s=TIMEOUT_S)
    with pytest.raises(ValueError, match="target 1 .* lacks prepare_weights_from_distributed"):
        sender.send(make_params(1), [FakeTarget(make_params(0)), OnePhase()])
    assert not sender.connected


def test_close_destroys_both_sides_and_the_name_can_be_reused(port):
    target = FakeTarget(make_params(0))
    for version in ("v1", "v2"):
        sender = WeightSender("127.0.0.1", port, 2, group_name="reused", timeout_s=TIMEOUT_S)
        sender.send(make_params(1), [target], weight_version=version)
        assert get_group("reused", 0).alive and get_group("reused", 1).alive
        with pytest.raises(KeyError):
            get_group("reused")  # this process holds two ranks of it
        with pytest.raises(ValueError):
            init_process_group("127.0.0.1", port, 1, 2, "reused", "gloo")
        sender.close([target])
        for rank in (0, 1):
            with pytest.raises(KeyError):
                get_group("reused", rank)
    assert target.version == "v2"
    assert not destroy_group("reused")


def test_groups_coexist_with_default_group_and_each_other():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    pairs = [(WeightSender("127.0.0.1", free_port(), 2, group_name=name, timeout_s=TIMEOUT_S),
              FakeTarget(make_params(0))) for name in ("first", "second")]
    try:
        for step in range(2):
            for i, (sender, target) in enumerate(pairs):
                new = make_params(10 * step + i)
                sender.send(new, [target], weight_version=f"v{step}")
                assert_same(target.params, new)
        total = torch.ones(3)
        dist.all_reduce(total)
        assert torch.equal(total, torch.ones(3)) and dist.get_world_size() == 1
    finally:
        for sender, target in pairs:
            sender.close([target])
        dist.destroy_process_group()


def test_silent_peer_times_out(port):
    release = threading.Event()

    def silent_sender():
        group = init_process_group("127.0.0.1", port, 0, 2, "quiet", "gloo", timeout_s=1.0)
        release.wait(30)
        group.destroy()

    thread = threading.Thread(target=silent_sender)
    thread.start()
    try:
        group = init_process_group("127.0.0.1", port, 1, 2, "quiet", "gloo", timeout_s=1.0)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="rank 1"):
            list(receive_tensors(group, ["w"], ["float32"], [[4]]))
        assert 0.9 < time.monotonic() - start < 4.0
        group.destroy()
    finally:
        release.set()
        thread.join()


def _sender_then_hang(port: int, conn) -> None:
    group = init_process_group("127.0.0.1", port, 0, 2, "doomed", "gloo", timeout_s=TIMEOUT_S)
    group.broadcast(torch.arange(4.0))
    conn.send("sent")
    time.sleep(60)


def test_killed_sender_makes_receiver_raise(port):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender_then_hang, args=(port, child), daemon=True)
    proc.start()
    try:
        group = init_process_group("127.0.0.1", port, 1, 2, "doomed", "gloo",
                                   timeout_s=TIMEOUT_S)
        tensors = receive_tensors(group, ["a", "b"], ["float32"] * 2, [[4], [1 << 20]])
        name, first = next(tensors)
        assert name == "a" and torch.equal(first, torch.arange(4.0))
        assert parent.recv() == "sent"
        threading.Timer(0.3, proc.kill).start()
        start = time.monotonic()
        with pytest.raises(WeightSyncError):
            next(tensors)  # blocked in the broadcast of "b" when the sender dies
        assert time.monotonic() - start < TIMEOUT_S + 3
        group.destroy()
    finally:
        proc.kill()
        proc.join()


def _serve_target(conn) -> None:
    target = FakeTarget(make_params(0))
    while True:
        method, kwargs = conn.recv()
        if method == "exit_after":
            target.exit_after = kwargs["n"]
            conn.send(None)
            continue
        try:
            conn.send(getattr(target, method)(**kwargs))
        except Exception as err:
            conn.send({"success": False, "message": repr(err)})


class ProcessTarget:
    """Drives a FakeTarget in a child process over a pipe."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_target, args=(child,), daemon=True)
        self.proc.start()
        child.close()  # so that a dead child reads as EOF here

    def call(self, method: str, **kwargs):
        self.conn.send((method, kwargs))
        return self.conn.recv()

    def init_weights_update_group(self, **kwargs):
        return self.call("init_weights_update_group", **kwargs)

    def update_weights_from_distributed(self, **kwargs):
        return self.call("update_weights_from_distributed", **kwargs)

    def destroy_weights_update_group(self, **kwargs):
        return self.call("destroy_weights_update_group", **kwargs)


def test_cross_process_send_then_receiver_dies_mid_transfer(port):
    target = ProcessTarget()
    sender = WeightSender("127.0.0.1", port, 2, timeout_s=TIMEOUT_S)
    try:
        reply = sender.send(make_params(1), [target], weight_version="v1", load_format=None)
        assert reply == [{"success": True, "message": "", "weight_version": "v1"}]
        target.call("exit_after", n=2)
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as info:
            sender.send(make_params(2), [target], weight_version="v2", load_format=None)
        assert time.monotonic() - start < TIMEOUT_S + 3
        assert "broadcast failed" in str(info.value) and "target 0" in str(info.value)
        assert not sender.connected
        with pytest.raises(KeyError):
            get_group("weight_update_group", 0)
    finally:
        target.proc.kill()
        target.proc.join()
        sender.close([])


def test_contiguous_destinations_are_received_as_one_span():
    from hotswap.weight_sync.receiver import _contiguous_span

    flat = torch.zeros(10)
    a, b = flat[:4].view(2, 2), flat[4:10].view(3, 2)
    span = _contiguous_span([a, b], torch.device("cpu"))
    assert span is not None and span.data_ptr() == flat.data_ptr() and span.numel() == 10
    span.copy_(torch.arange(10.0))
    assert a.flatten().tolist() == [0, 1, 2, 3] and b.flatten().tolist() == [4, 5, 6, 7, 8, 9]
    assert _contiguous_span([b, a], torch.device("cpu")) is None  # out of order
    assert _contiguous_span([a, torch.zeros(6)], torch.device("cpu")) is None  # other storage
    assert _contiguous_span([a, None], torch.device("cpu")) is None


def _ties(n: int) -> torch.Tensor:
    """fp32 values exactly halfway between two bf16 values, both parities: rounding to nearest
    even goes down for half of them and up for the others (truncation would not)."""
    low = torch.arange(0x3F80, 0x3F80 + n, dtype=torch.int32) << 16
    return (low | 0x8000).view(torch.float32)


class ConvertingTarget:
    """An engine stand-in keeping bf16 weights, fed fp32 (and bf16) tensors: it receives into
    its weights through one kept Landing. flat: the weights lie back to back in one buffer, in
    the order sent (a bucket's span is converted at once); else each is its own tensor.
    `weights_dtype` (an Engine's attribute) is set by the tests that want the sender to see it;
    `sent` keeps the dtypes each update announced."""

    def __init__(self, params: dict[str, torch.Tensor], flat: bool = True) -> None:
        storage = torch.empty(sum(t.numel() for t in params.values()), dtype=BF16)
        self.params, offset = {}, 0
        for name, t in params.items():
            self.params[name] = (storage[offset: offset + t.numel()].view(t.shape) if flat
                                 else torch.empty(t.shape, dtype=BF16))
            offset += t.numel()
        self.landing = Landing()
        self.sent: list[list[str]] = []

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name, backend):
        init_process_group(master_address, master_port, rank_offset, world_size, group_name,
                           backend, timeout_s=TIMEOUT_S)
        return {"success": True, "message": ""}

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, weight_version,
                                        flush_cache, pause_mode, load_format):
        self.sent.append(list(dtypes))
        received = receive_tensors(get_group(group_name, 1), names, dtypes, shapes, load_format,
                                   into=self.params, landing=self.landing)
        assert all(t is self.params[n] for n, t in received)
        return {"success": True, "message": "", "weight_version": weight_version}

    def destroy_weights_update_group(self, group_name):
        destroy_group(group_name, 1)
        return {"success": True, "message": ""}


@pytest.mark.parametrize("flat", [True, False], ids=["one-buffer", "separate"])
@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_fp32_tensors_land_in_bf16_weights_rounded_as_torch_rounds(port, load_format, flat):
    new = make_params(1)
    new["lm_head.weight"] = torch.cat([_ties(64), torch.randn(64)]).view(16, 8)
    target = ConvertingTarget(new, flat)
    sender = WeightSender("127.0.0.1", port, 2, bucket_bytes=1024, timeout_s=TIMEOUT_S)
    try:
        sender.send(new, [target], weight_version="v1", load_format=load_format)
        for name, tensor in new.items():
            assert torch.equal(target.params[name], tensor.to(BF16)), name
        assert target.landing.nbytes > 0  # the fp32 tensors landed in the caller's buffers
        newer = {n: t * 3 for n, t in new.items()}
        sender.send(newer, [target], weight_version="v2", load_format=load_format)
        for name, tensor in newer.items():
            assert torch.equal(target.params[name], tensor.to(BF16)), name
    finally:
        sender.close([target])


def test_a_destination_of_a_non_float_dtype_is_refused(port):
    group = init_process_group("127.0.0.1", port, 0, 1, "int-dest", "gloo", timeout_s=1.0)
    try:
        with pytest.raises(ValueError, match="destination of 'w' is torch.int32"):
            receive_tensors(group, ["w"], ["float32"], [[4]],
                            into={"w": torch.zeros(4, dtype=torch.int32)})
    finally:
        group.destroy()


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_targets_reporting_bf16_weights_get_fp32_tensors_rounded_before_the_wire(
        port, load_format):
    new = make_params(1)
    new["lm_head.weight"] = torch.cat([_ties(64), torch.randn(64)]).view(16, 8)
    target = ConvertingTarget(new)
    target.weights_dtype = "bfloat16"
    sender = WeightSender("127.0.0.1", port, 2, bucket_bytes=1024, timeout_s=TIMEOUT_S)
    try:
        sender.send(new, [target], load_format=load_format)
        assert target.sent == [["bfloat16"] * len(new)]
        assert sender.last_push["bytes"] == sum(t.numel() * 2 for t in new.values())
        for name, tensor in new.items():
            assert torch.equal(target.params[name], tensor.to(BF16)), name
        assert target.landing.nbytes == 0  # nothing to convert on arrival
    finally:
        sender.close([target])


def test_tensors_are_never_widened_to_the_targets_dtype(port):
    new = make_params(1)
    target = FakeTarget(make_params(0), direct=True)
    target.weights_dtype = "float32"
    target.params = {n: t.clone() for n, t in new.items()}
    sender = WeightSender("127.0.0.1", port, 2, bucket_bytes=1024, timeout_s=TIMEOUT_S)
    try:
        sender.send(new, [target])
        assert sender.last_push["bytes"] == sum(t.nbytes for t in new.values())
        assert_same(target.params, new)  # the bf16 tensors arrived as bf16
    finally:
        sender.close([target])
