"""What the expert store did during a run, per phase: hits per layer, loads, bytes per tier, load time.

Definitions (also printed in the run's table):
- hit: the expert was already in the device tier (resident or loading) when its layer asked for it;
- on-demand load: issued when the layer asked; ahead-of-time load: issued before (prefetch);
- load time (wall): wall-clock time during which at least one load was in flight, from its issue to its
  completion (queueing included); exposed: the part of it the compute thread spent waiting for a load;
  hidden = load time - exposed (overlapped with compute), so exposed + hidden = load time always;
- I/O thread time: the duration of every disk read and copy summed over the I/O threads (it can exceed the
  wall time when reads run in parallel). On CUDA a host->device copy is awaited on the GPU stream, not by
  the host, so its time is counted in neither.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from moepager.store.budget import format_bytes
from moepager.types import Phase


@dataclass
class PhaseCounters:
    hits: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    misses: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    loads_on_demand: int = 0
    loads_ahead: int = 0
    prefetch_used: int = 0
    """Prefetched experts their layer then used."""
    prefetch_wasted: int = 0
    """Prefetched (loaded) experts their layer did not use."""
    prefetch_cancelled: int = 0
    """Prefetches cancelled before they started (needed ones are then loaded on demand)."""
    host_hits: int = 0
    on_cpu: int = 0
    """Misses computed on the CPU where they are, in the host tier (hybrid execution): no transfer to the device."""
    disk_reads: int = 0
    bytes_disk: int = 0
    bytes_host_to_device: int = 0
    load_s: float = 0.0
    """Read and copy durations summed over I/O threads."""
    exposed_s: float = 0.0
    in_flight: IntervalUnion = field(default_factory=lambda: IntervalUnion())
    """(issued, completed) of every load, for the wall time during which loads were in flight."""
    disk_busy: IntervalUnion = field(default_factory=lambda: IntervalUnion())
    """(start, end) of every disk read, to compute the read bandwidth the disk actually delivered."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def disk_read(self, nbytes: int, start: float, end: float) -> None:
        """Called from I/O threads."""
        with self._lock:
            self.disk_reads += 1
            self.bytes_disk += nbytes
            self.load_s += end - start
            self.disk_busy.add(start, end)

    def loaded(self, issued: float, completed: float) -> None:
        """A load issued at `issued` finished at `completed` (perf_counter seconds); any thread."""
        with self._lock:
            self.in_flight.add(issued, completed)

    def copy(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes_host_to_device += nbytes
            self.load_s += seconds

    @property
    def disk_busy_s(self) -> float:
        """Wall time during which at least one disk read was running."""
        return self.disk_busy.total_s

    @property
    def load_wall_s(self) -> float:
        """Wall time during which at least one load was in flight (issued, not yet complete)."""
        return self.in_flight.total_s

    def summary(self, tokens: int, expert_bytes: int = 0) -> dict[str, Any]:
        layers = sorted(set(self.hits) | set(self.misses))
        hits, accesses = sum(self.hits.values()), sum(self.hits.values()) + sum(self.misses.values())
        busy, wall = self.disk_busy_s, self.load_wall_s
        exposed = min(self.exposed_s, wall)  # a wait is always for a load in flight; min() absorbs clock jitter
        return {
            "tokens": tokens,
            "hit_rate": hits / accesses if accesses else 1.0,
            "hit_rate_per_layer": {str(layer): self.hits[layer] / (self.hits[layer] + self.misses[layer])
                                   for layer in layers},
            "accesses": accesses,
            "loads_on_demand": self.loads_on_demand,
            "loads_ahead": self.loads_ahead,
            "prefetch_used": self.prefetch_used,
            "prefetch_wasted": self.prefetch_wasted,
            "prefetch_cancelled": self.prefetch_cancelled,
            "prefetch_accuracy": self.prefetch_used / max(1, self.prefetch_used + self.prefetch_wasted),
            "prefetch_wasted_bytes": self.prefetch_wasted * expert_bytes,
            "host_hits": self.host_hits,
            "computed_on_cpu": self.on_cpu,
            "disk_reads": self.disk_reads,
            "bytes_disk": self.bytes_disk,
            "bytes_host_to_device": self.bytes_host_to_device,
            "bytes_disk_per_token": self.bytes_disk / tokens if tokens else 0.0,
            "bytes_host_to_device_per_token": self.bytes_host_to_device / tokens if tokens else 0.0,
            "load_s": wall,
            "exposed_s": exposed,
            "hidden_s": wall - exposed,
            "io_thread_s": self.load_s,
            "disk_busy_s": busy,
            "disk_read_bytes_per_s": self.bytes_disk / busy if busy else 0.0,
        }


class IntervalUnion:
    """The length of a union of (start, end) intervals, in bounded memory (a server adds them for days): beyond
    `keep` intervals, those ending more than `horizon_s` before the latest start are folded into a total (a load
    never takes that long, so no later interval can overlap them)."""

    def __init__(self, keep: int = 4096, horizon_s: float = 60.0):
        self.keep, self.horizon_s = keep, horizon_s
        self.intervals: list[tuple[float, float]] = []
        self.folded_s = 0.0
        self._limit = keep
        """Fold when this many intervals are held: at least twice what the last fold kept (amortised O(log n))."""

    def add(self, start: float, end: float) -> None:
        self.intervals.append((start, end))
        if len(self.intervals) > self._limit:
            self._fold()
            self._limit = max(self.keep, 2 * len(self.intervals))

    def _fold(self) -> None:
        """Merge into disjoint intervals; fold those that end before the horizon, keep the rest."""
        cutoff = max(a for a, _ in self.intervals) - self.horizon_s
        merged: list[tuple[float, float]] = []
        for a, b in sorted(self.intervals):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.folded_s += sum(b - a for a, b in merged if b < cutoff)
        self.intervals = [iv for iv in merged if iv[1] >= cutoff]

    @property
    def total_s(self) -> float:
        return self.folded_s + union_s(self.intervals)


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class StoreCounters:
    """Counters of the current phase (`current`), switched by the generation loop through `set_phase`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.phases: dict[Phase, PhaseCounters] = {"prefill": PhaseCounters(), "decode": PhaseCounters()}
        self.phase: Phase = "prefill"
        """The phase of the pass running now (the engine announces each pass; a model called without announcing
        any stays in prefill)."""
        self.current = self.phases["prefill"]

    def set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self.current = self.phases[phase]


@dataclass
class StoreReport:
    """One run's expert statistics: a section of RunStats (table rows and JSON)."""

    config: dict[str, Any]
    phases: dict[str, dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, **self.phases}

    def rows(self) -> list[tuple[str, str]]:
        rows = [("experts", ", ".join(f"{k} {v}" for k, v in self.config.items()))]
        for phase, s in self.phases.items():
            if not s["accesses"]:
                continue
            per_layer = " ".join(f"{100 * v:.0f}" for v in s["hit_rate_per_layer"].values())
            rows += [
                (f"{phase} expert hit rate", f"{100 * s['hit_rate']:.1f}% (per layer %: {per_layer})"),
                (f"{phase} loads", f"{s['loads_on_demand']} on demand, {s['loads_ahead']} ahead, "
                                   f"{s['host_hits']} from host cache, {s['disk_reads']} from disk"),
            ]
            if s["computed_on_cpu"]:
                rows.append((f"{phase} on the CPU", f"{s['computed_on_cpu']} missed experts computed in host memory "
                                                    "(hybrid execution: no copy)"))
            if s["loads_ahead"]:
                rows.append((f"{phase} prefetch", f"{s['prefetch_used']} used, {s['prefetch_wasted']} wasted "
                             f"({format_bytes(s['prefetch_wasted_bytes'])}), {s['prefetch_cancelled']} cancelled; "
                             f"accuracy {100 * s['prefetch_accuracy']:.1f}%"))
            rows += [
                (f"{phase} bytes/token", f"disk {format_bytes(s['bytes_disk_per_token'])}, host->device "
                                         f"{format_bytes(s['bytes_host_to_device_per_token'])}"),
                (f"{phase} load time", f"{s['load_s'] * 1e3:.1f} ms wall with loads in flight = "
                                       f"{s['exposed_s'] * 1e3:.1f} exposed + {s['hidden_s'] * 1e3:.1f} hidden "
                                       f"({s['io_thread_s'] * 1e3:.1f} ms summed over I/O threads)"),
            ]
            if s["disk_busy_s"]:
                rows.append((f"{phase} disk read", f"{s['disk_read_bytes_per_s'] / 1e9:.2f} GB/s while busy"))
        return rows
