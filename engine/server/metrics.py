"""Prometheus metrics of one server: HTTP counters it records, engine state read at scrape time.

Each app gets its own registry, so several servers (or tests) in one process never collide.
Engine values (token counters, queue lengths, KV use) are owned by the scheduler and read when
scraped through `Engine.get_load()`: counts read at once, never a walk over structures the
scheduler thread is mutating, and never a wait for a step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_UPDATE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class EngineCollector(Collector):
    """Reads an Engine's counters and gauges when Prometheus scrapes."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        load = self.engine.get_load()
        stats = load["totals"]
        for key, doc in (("prompt_tokens", "Prompt tokens submitted"),
                         ("generated_tokens", "Tokens generated"),
                         ("cached_tokens", "Prompt tokens served from the prefix cache"),
                         ("prefill_tokens", "Tokens computed in prefill"),
                         ("steps", "Forward steps run"),
                         ("spec_verify_steps", "Speculative verify rows (a request's drafts "
                          "checked in one forward)"),
                         ("spec_draft_tokens", "Drafted tokens fed to verify rows"),
                         ("spec_accepted_tokens", "Drafted tokens the target kept")):
            yield CounterMetricFamily(f"hotswap_{key}", doc, value=stats.get(key, 0))
        verify = stats.get("spec_verify_steps", 0)
        yield GaugeMetricFamily("hotswap_spec_accept_length",
                                "Drafted tokens kept per verify row, since start",
                                value=stats.get("spec_accepted_tokens", 0) / verify
                                if verify else 0.0)
        yield from self._draft_metrics(load.get("speculative"))
        prompt = stats.get("prompt_tokens", 0)
        yield GaugeMetricFamily("hotswap_cache_hit_rate",
                                "Share of submitted prompt tokens found in the prefix cache",
                                value=stats.get("cached_tokens", 0) / prompt if prompt else 0.0)
        yield GaugeMetricFamily("hotswap_num_running_requests", "Requests holding KV",
                                value=load["running"])
        yield GaugeMetricFamily("hotswap_num_waiting_requests", "Requests queued for admission",
                                value=load["waiting"])
        yield from self._kv_metrics(load)
        yield from self._weight_metrics()

    @staticmethod
    def _draft_metrics(spec: dict[str, Any] | None) -> Iterator[Metric]:
        """A learned draft's state: drafting or switched off (acceptance under the floor),
        made for the serving policy or an older one, and its live acceptance."""
        if spec is None or "draft_version" not in spec:
            return
        yield GaugeMetricFamily("hotswap_spec_draft_active", "1 while the learned draft "
                                "drafts, 0 once its acceptance fell under the floor",
                                value=float(spec["active"]))
        yield GaugeMetricFamily("hotswap_spec_draft_stale", "1 while the learned draft was "
                                "made for an older policy version", value=float(spec["stale"]))
        yield GaugeMetricFamily("hotswap_spec_draft_acceptance", "Drafted tokens kept per "
                                "drafted token since the draft or the policy last changed",
                                value=spec["acceptance"] or 0.0)

    def _kv_metrics(self, load: dict[str, Any]) -> Iterator[Metric]:
        size, used = load["kv_pool_tokens"], load["kv_used_tokens"]
        yield GaugeMetricFamily("hotswap_kv_pool_tokens", "KV pool size in tokens", value=size)
        yield GaugeMetricFamily("hotswap_kv_cached_tokens", "KV tokens held by the prefix cache",
                                value=load["kv_cached_tokens"])
        yield GaugeMetricFamily("hotswap_kv_usage",
                                "Share of the KV pool not free (running requests and cache)",
                                value=used / size if size else 0.0)

    def _weight_metrics(self) -> Iterator[Metric]:
        weights = self.engine.weights
        info = GaugeMetricFamily("hotswap_weight_version_info", "The weight version serving",
                                 labels=["version"])
        info.add_metric([str(weights.version)], 1.0)
        yield info
        yield GaugeMetricFamily("hotswap_weights_incomplete",
                                "1 while a failed update left the weights partly overwritten",
                                value=float(weights.incomplete is not None))
        if weights.last_update_s is not None:
            yield GaugeMetricFamily("hotswap_weight_update_apply_seconds",
                                    "Scheduler-side time of the last committed weight update",
                                    value=weights.last_update_s)


class ServerMetrics:
    def __init__(self, engine: Any):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.requests = Counter("hotswap_http_requests", "HTTP requests answered",
                                ["route", "status"], registry=self.registry)
        self.finished = Counter("hotswap_finished_requests",
                                "Generation requests finished, by finish reason",
                                ["reason"], registry=self.registry)
        self.e2e = Histogram("hotswap_e2e_request_latency_seconds",
                             "Engine latency of a request, submit to finish",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("hotswap_time_to_first_token_seconds",
                              "Time to the first streamed token", buckets=_LATENCY_BUCKETS,
                              registry=self.registry)
        self.updates = Counter("hotswap_weight_updates",
                               "Weight update calls, by source and result",
                               ["source", "result"], registry=self.registry)
        self.update_seconds = Histogram("hotswap_weight_update_seconds",
                                        "Wall time of weight update calls, transfer included",
                                        ["source"], buckets=_UPDATE_BUCKETS,
                                        registry=self.registry)

    def observe_output(self, meta: dict[str, Any]) -> None:
        """Record one finished request from its final meta_info."""
        reason = meta.get("finish_reason") or {}
        self.finished.labels(reason.get("type", "unknown")).inc()
        if isinstance(meta.get("e2e_latency"), float):
            self.e2e.observe(meta["e2e_latency"])

    def observe_update(self, source: str, seconds: float, success: bool) -> None:
        self.update_seconds.labels(source).observe(seconds)
        self.updates.labels(source, "success" if success else "failure").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
