"""What the server reports at /metrics (Prometheus text format, written by `prometheus_client`) and /v1/stats (JSON
for the web page).

Request metrics are counted as requests finish (histograms of TTFT, TPOT, latency and step time); engine and store
metrics are read when asked, by a collector that takes one snapshot per scrape: requests running and waiting, KV
cache blocks in use, and the expert store's counters since the server started (hits per layer, bytes read from disk
and copied host->device, load time the compute thread was exposed to). Each app has a registry of its own.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from moepager.accel import cpu_kernels
from moepager.runtime.engine import Engine, StepStats
from moepager.runtime.request import Request

if TYPE_CHECKING:  # the store's public counters and occupancy, read at scrape time
    from moepager.store.store import ExpertStore

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_WINDOW_S = 10.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, engine: Engine, store: ExpertStore | None, model_name: str):
        self.engine, self.store, self.model_name = engine, store, model_name
        self.started_s = time.time()
        self.finished: dict[str, int] = {}
        self.prompt_tokens = self.generation_tokens = 0
        self.registry = CollectorRegistry(auto_describe=True)

        def histogram(name: str, text: str) -> Histogram:
            return Histogram(name, text, buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.ttft = histogram("moepager_time_to_first_token_seconds", "Arrival to first token.")
        self.tpot = histogram("moepager_time_per_output_token_seconds", "Gap between consecutive tokens.")
        self.e2e = histogram("moepager_request_latency_seconds", "Arrival to finish.")
        self.steps = histogram("moepager_step_seconds", "Duration of each engine step (schedule, forward, sample).")
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self.registry.register(_Snapshot(self))

    # -- the engine thread ----------------------------------------------------------------------------------
    def step(self, step: StepStats | None) -> None:
        if step is None:
            return
        now = time.perf_counter()
        with self._lock:
            self.steps.observe(step.duration_s)
            if step.sampled:
                self._recent.append((now, step.sampled))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def finish(self, request: Request) -> None:
        with self._lock:
            reason = request.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += len(request.prompt_ids)
            self.generation_tokens += len(request.out_ids)
            s = request.stats
            if s.ttft_s is not None:
                self.ttft.observe(s.ttft_s)
            for gap in s.tpot_s:
                self.tpot.observe(gap)
            if s.finished_s is not None:
                self.e2e.observe(s.finished_s - s.arrival_s)

    # -- readers ----------------------------------------------------------------------------------------------
    def tokens_per_s(self) -> float:
        with self._lock:
            now = time.perf_counter()
            recent = [n for t, n in self._recent if t >= now - RATE_WINDOW_S]
        return sum(recent) / RATE_WINDOW_S

    def experts(self) -> dict[str, Any]:
        """The store's counters summed over both phases (all resident: nothing moves)."""
        if self.store is None:
            return {"paged": False, "hit_rate": 1.0, "hit_rate_per_layer": {}, "bytes_disk": 0,
                    "bytes_host_to_device": 0, "exposed_load_s": 0.0, "slots_used": 0, "slots": 0}
        phases = list(self.store.counters.phases.values())
        used, slots = self.store.occupancy()
        hits = {layer: sum(p.hits.get(layer, 0) for p in phases) for layer in self.store.layers()}
        misses = {layer: sum(p.misses.get(layer, 0) for p in phases) for layer in hits}
        total = sum(hits.values()) + sum(misses.values())
        return {"paged": True, "hit_rate": sum(hits.values()) / total if total else 1.0,
                "hit_rate_per_layer": {str(layer): hits[layer] / (hits[layer] + misses[layer])
                                       for layer in hits if hits[layer] + misses[layer]},
                "bytes_disk": sum(p.bytes_disk for p in phases),
                "bytes_host_to_device": sum(p.bytes_host_to_device for p in phases),
                "exposed_load_s": sum(p.exposed_s for p in phases),
                "slots_used": used, "slots": slots}

    def snapshot(self) -> dict[str, Any]:
        pool, scheduler = self.engine.pool, self.engine.scheduler
        with self._lock:
            finished = dict(self.finished)
            tokens = (self.prompt_tokens, self.generation_tokens)
        return {"model": self.model_name, "uptime_s": time.time() - self.started_s,
                "requests_running": len(scheduler.running), "requests_waiting": len(scheduler.waiting),
                "requests_finished": finished, "preemptions": scheduler.preemptions,
                "prompt_tokens": tokens[0], "generation_tokens": tokens[1],
                "tokens_per_s": self.tokens_per_s(),
                "kv_cache": {"blocks_used": pool.num_blocks - 1 - len(pool.free), "blocks": pool.num_blocks - 1,
                             "block_size": pool.block_size},
                "experts": self.experts(), "cpu_kernels": cpu_kernels.chosen_tier()}

    def prometheus(self) -> bytes:
        """The exposition of every metric (one snapshot of the engine and store)."""
        return generate_latest(self.registry)


class _Snapshot(Collector):
    """Engine and store metrics, read from one snapshot at each scrape."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snap = self.metrics.snapshot()
        ex, kv = snap["experts"], snap["kv_cache"]

        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, value=value)

        def counter(name: str, text: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, text, value=value)

        yield gauge("moepager_requests_running", "Requests in the running batch.", snap["requests_running"])
        yield gauge("moepager_requests_waiting", "Requests waiting for a place in the batch.",
                    snap["requests_waiting"])
        finished = CounterMetricFamily("moepager_requests_finished", "Requests finished, by reason.",
                                       labels=["reason"])
        for reason, n in sorted(snap["requests_finished"].items()):
            finished.add_metric([reason], n)
        yield finished
        yield counter("moepager_prompt_tokens", "Prompt tokens of finished requests.", snap["prompt_tokens"])
        yield counter("moepager_generation_tokens", "Tokens generated for finished requests.",
                      snap["generation_tokens"])
        yield gauge("moepager_tokens_per_second", f"Tokens sampled per second over the last {RATE_WINDOW_S:g} s.",
                    snap["tokens_per_s"])
        yield counter("moepager_preemptions", "Requests preempted because the KV cache ran out.", snap["preemptions"])
        yield gauge("moepager_kv_cache_usage_ratio", "Share of KV cache blocks held by requests.",
                    kv["blocks_used"] / max(1, kv["blocks"]))
        hit = GaugeMetricFamily("moepager_expert_hit_rate",
                                "Share of expert accesses served from the device tier (1 = all resident); per layer "
                                "with the layer label.", labels=["layer"])
        hit.add_sample("moepager_expert_hit_rate", {}, ex["hit_rate"])
        for layer, rate in ex["hit_rate_per_layer"].items():
            hit.add_metric([layer], rate)
        yield hit
        moved = CounterMetricFamily("moepager_expert_bytes", "Expert bytes moved, by tier crossing.", labels=["tier"])
        moved.add_metric(["disk"], ex["bytes_disk"])
        moved.add_metric(["host_to_device"], ex["bytes_host_to_device"])
        yield moved
        yield counter("moepager_expert_load_exposed_seconds", "Time the compute thread waited for expert loads.",
                      ex["exposed_load_s"])
        yield gauge("moepager_expert_slots_used", "Device expert slots holding an expert.", ex["slots_used"])
