"""HostKVPool's CUDA ordering, checked with a fake stream API: the host -> device copy runs on the
side stream after it waits for the compute stream, and the compute stream waits on its event."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hotswap.engine.kvcache.host_pool import HostKVPool
from hotswap.engine.kvcache.memory import KVPool


class FakeStreams:
    """torch.cuda's stream calls, recorded in order; `current` is the stream work goes to."""

    def __init__(self):
        self.log: list[tuple] = []
        self.compute = "compute"
        self.current = self.compute

    def stream_factory(self, device=None):
        streams = self

        class Stream:
            name = "side"

            def wait_stream(self, other):
                streams.log.append(("wait_stream", self.name, other))

            def __repr__(self):
                return self.name

        return Stream()

    def current_stream(self, device=None):
        streams = self

        class Current:
            name = streams.current

            def wait_event(self, event):
                streams.log.append(("wait_event", self.name, event.recorded_on))

            def __eq__(self, other):
                return other == self.name

        return Current()

    @contextlib.contextmanager
    def stream(self, s):
        previous, self.current = self.current, s.name
        self.log.append(("enter", s.name))
        yield
        self.log.append(("exit", s.name))
        self.current = previous

    def event_factory(self, *args, **kwargs):
        streams = self

        class Event:
            recorded_on = None

            def record(self, s=None):
                self.recorded_on = s.name if s is not None else streams.current
                streams.log.append(("record", self.recorded_on))

        return Event()


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeStreams()
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "Event", fake.event_factory)

    def pin_memory(t, *args, **kwargs):  # where the staging copy is issued
        fake.log.append(("stage", fake.current))
        return t

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return fake


def test_load_copies_on_the_side_stream_and_compute_waits_for_it(fake_cuda):
    pool = KVPool(num_pages=8, page_size=2, num_layers=2, num_kv_heads=2, head_dim=4,
                  dtype=torch.float32, device="cpu")
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape))
    host = HostKVPool(12, pool)
    host._stream = fake_cuda.stream_factory()  # as a CUDA pool builds it
    slots = host.allocator.alloc(4)
    host.backup(torch.tensor([2, 3, 4, 5]), slots)
    host.load(slots, torch.tensor([12, 13, 14, 15]))
    assert fake_cuda.log == [
        ("wait_stream", "side", "compute"),  # the slots may still be in use by compute
        ("enter", "side"),
        ("stage", "side"),
        ("record", "side"),
        ("exit", "side"),
        ("wait_event", "compute", "side"),  # the next forward reads whole pages
    ]
    for buf in pool.k_buffers + pool.v_buffers:
        assert torch.equal(buf[12:16], buf[2:6])
