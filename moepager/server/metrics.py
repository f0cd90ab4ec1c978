"""What the server reports at /metrics (Prometheus text format 0.0.4) and /v1/stats (JSON for the web page).

Request metrics are counted as requests finish; engine and store metrics are read when asked: requests running
and waiting, KV cache blocks in use, and the expert store's counters since the server started (hits per layer,
bytes read from disk and copied host->device, load time the compute thread was exposed to).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from moepager.runtime.engine import Engine, StepStats
from moepager.runtime.request import Request
from moepager.store.store import ExpertStore

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_WINDOW_S = 10.0


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{le="{bound}"}} {n}' for bound, n in zip(self.buckets, self.counts)]
        return lines + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


class Metrics:
    def __init__(self, engine: Engine, store: ExpertStore | None, model_name: str):
        self.engine, self.store, self.model_name = engine, store, model_name
        self.started_s = time.time()
        self.finished: dict[str, int] = {}
        self.prompt_tokens = self.generation_tokens = 0
        self.ttft = Histogram(LATENCY_BUCKETS_S)
        self.tpot = Histogram(LATENCY_BUCKETS_S)
        self.e2e = Histogram(LATENCY_BUCKETS_S)
        self.steps = Histogram(LATENCY_BUCKETS_S)
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

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
        hits = {layer: sum(p.hits.get(layer, 0) for p in phases) for layer in self.store.device.table.by_layer}
        misses = {layer: sum(p.misses.get(layer, 0) for p in phases) for layer in hits}
        total = sum(hits.values()) + sum(misses.values())
        table = self.store.device.table
        return {"paged": True, "hit_rate": sum(hits.values()) / total if total else 1.0,
                "hit_rate_per_layer": {str(layer): hits[layer] / (hits[layer] + misses[layer])
                                       for layer in hits if hits[layer] + misses[layer]},
                "bytes_disk": sum(p.bytes_disk for p in phases),
                "bytes_host_to_device": sum(p.bytes_host_to_device for p in phases),
                "exposed_load_s": sum(p.exposed_s for p in phases),
                "slots_used": len(table.slot_of), "slots": table.capacity}

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
                "experts": self.experts()}

    def prometheus(self) -> str:
        snap = self.snapshot()
        ex, kv = snap["experts"], snap["kv_cache"]
        lines = [
            "# HELP moepager_requests_running Requests in the running batch.", "# TYPE moepager_requests_running gauge",
            f"moepager_requests_running {snap['requests_running']}",
            "# HELP moepager_requests_waiting Requests waiting for a place in the batch.",
            "# TYPE moepager_requests_waiting gauge", f"moepager_requests_waiting {snap['requests_waiting']}",
            "# HELP moepager_requests_finished_total Requests finished, by reason.",
            "# TYPE moepager_requests_finished_total counter",
            *[f'moepager_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(snap["requests_finished"].items())],
            "# HELP moepager_prompt_tokens_total Prompt tokens of finished requests.",
            "# TYPE moepager_prompt_tokens_total counter", f"moepager_prompt_tokens_total {snap['prompt_tokens']}",
            "# HELP moepager_generation_tokens_total Tokens generated for finished requests.",
            "# TYPE moepager_generation_tokens_total counter",
            f"moepager_generation_tokens_total {snap['generation_tokens']}",
            f"# HELP moepager_tokens_per_second Tokens sampled per second over the last {RATE_WINDOW_S:g} s.",
            "# TYPE moepager_tokens_per_second gauge", f"moepager_tokens_per_second {snap['tokens_per_s']}",
            "# HELP moepager_preemptions_total Requests preempted because the KV cache ran out.",
            "# TYPE moepager_preemptions_total counter", f"moepager_preemptions_total {snap['preemptions']}",
            "# HELP moepager_kv_cache_usage_ratio Share of KV cache blocks held by requests.",
            "# TYPE moepager_kv_cache_usage_ratio gauge",
            f"moepager_kv_cache_usage_ratio {kv['blocks_used'] / max(1, kv['blocks'])}",
            "# HELP moepager_expert_hit_rate Share of expert accesses served from the device tier (1 = all resident).",
            "# TYPE moepager_expert_hit_rate gauge", f"moepager_expert_hit_rate {ex['hit_rate']}",
            *[f'moepager_expert_hit_rate{{layer="{layer}"}} {rate}' for layer, rate in ex["hit_rate_per_layer"].items()],
            "# HELP moepager_expert_bytes_total Expert bytes moved, by tier crossing.",
            "# TYPE moepager_expert_bytes_total counter",
            f'moepager_expert_bytes_total{{tier="disk"}} {ex["bytes_disk"]}',
            f'moepager_expert_bytes_total{{tier="host_to_device"}} {ex["bytes_host_to_device"]}',
            "# HELP moepager_expert_load_exposed_seconds_total Time the compute thread waited for expert loads.",
            "# TYPE moepager_expert_load_exposed_seconds_total counter",
            f"moepager_expert_load_exposed_seconds_total {ex['exposed_load_s']}",
            "# HELP moepager_expert_slots_used Device expert slots holding an expert.",
            "# TYPE moepager_expert_slots_used gauge", f"moepager_expert_slots_used {ex['slots_used']}",
        ]
        with self._lock:
            lines += self.ttft.render("moepager_time_to_first_token_seconds", "Arrival to first token.")
            lines += self.tpot.render("moepager_time_per_output_token_seconds", "Gap between consecutive tokens.")
            lines += self.e2e.render("moepager_request_latency_seconds", "Arrival to finish.")
            lines += self.steps.render("moepager_step_seconds", "Duration of each engine step (schedule, forward, sample).")
        return "\n".join(lines) + "\n"
