"""The eviction-policy seam: a policy ranks candidates; the cache that asks owns the data and invariants.

Every policy here is a pure priority function over statistics the cache keeps (`AccessStats`): lower priority
is evicted first, ties go to the lower index (the lower `ExpertKey`). One function serves both users:
- the engine's store calls the `EvictionPolicy` protocol (`on_access` / `victims`); `Ranked` implements it by
  keeping the statistics per `ExpertKey` and ranking the offered candidates with `priority`;
- the trace simulator keeps the statistics itself as `[L, E]` arrays and calls `priority` on all of them at
  once, which is what makes it fast.
The store only ever offers experts it may evict (not in use, not loading), so a policy never has to know about
pins, buffers or tiers. `step` is the cache's clock: one tick per forward pass (in decode, one token).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np

from moepager.types import ExpertKey

NEVER = np.iinfo(np.int64).max // 4
"""`next_use` of an expert that is not requested again (Belady evicts it first)."""
DECAY = 0.98
"""Per step, the weight of a past request in `AccessStats.crf` (LRFU's 2^-lambda, Lee et al. 2001: a half-life of
~34 steps). On DeepSeek-V2-Lite's routing 0.97-0.98 rank best (README, `lrfu`)."""


class EvictionPolicy(Protocol):
    def on_access(self, keys: Sequence[ExpertKey], step: int) -> None:
        """`keys` were requested at `step` (hits and misses alike): a layer's experts at once."""
        ...

    def victims(self, candidates: Collection[ExpertKey], count: int, step: int) -> list[ExpertKey]:
        """The `count` of `candidates` (all evictable; count <= len(candidates)) to evict now, first to go first:
        what `count` evictions one after another would pick (a layer's misses are claimed at once)."""
        ...


class ForecastConsumer(Protocol):
    """A policy that ranks with a predictor's forecasts (fMoE's eviction weighs by them); the prefetcher is
    handed one when it is built and feeds it every forecast it makes."""

    def predict(self, layer: int, probs_E: np.ndarray) -> None:
        """A predictor's latest probabilities for `layer`'s experts."""
        ...


@dataclass
class AccessStats:
    """What a cache records per expert for its policy; all arrays share one shape (`[N]` or `[L, E]`)."""

    count: np.ndarray
    """int64: how many steps requested the expert so far (kept while it is out of the cache)."""
    last: np.ndarray
    """int64: the step of its last request; -1 if never requested."""
    prob: np.ndarray
    """float64: a predictor's probability that it is needed next; NaN where there is no prediction."""
    prior: np.ndarray
    """float64: prior activation frequency (static-hot); 0 where unknown."""
    next_use: np.ndarray
    """int64: the next step that requests it (offline knowledge, the simulator fills it for Belady); NEVER."""
    crf: np.ndarray
    """float64: its requests' combined recency and frequency at step `last`, sum of DECAY^(last - t) over the steps
    t that requested it (LRFU's CRF); its value at step s is crf * DECAY^(s - last) (`crf_now`)."""

    @classmethod
    def zeros(cls, shape: int | tuple[int, ...]) -> AccessStats:
        return cls(count=np.zeros(shape, np.int64), last=np.full(shape, -1, np.int64),
                   prob=np.full(shape, np.nan), prior=np.zeros(shape), next_use=np.full(shape, NEVER, np.int64),
                   crf=np.zeros(shape))

    def take(self, index: np.ndarray) -> AccessStats:
        return AccessStats(self.count[index], self.last[index], self.prob[index], self.prior[index],
                           self.next_use[index], self.crf[index])

    def touch(self, index: np.ndarray | tuple | int, step: int, crf: bool = True) -> None:
        """The experts at `index` are requested at `step` (each once: a mask or distinct indices); `crf` False leaves
        the CRF alone (a policy that does not rank by it: `Ranked.uses_crf`)."""
        if crf:
            self.crf[index] = crf_now(self.crf[index], self.last[index], step) + 1.0
        self.count[index] += 1
        self.last[index] = step

    def grown(self, size: int) -> AccessStats:
        """A copy with room for `size` entries (1-D stats only); new entries are never-requested."""
        bigger = AccessStats.zeros(size)
        n = len(self.count)
        for f in fields(self):
            getattr(bigger, f.name)[:n] = getattr(self, f.name)
        return bigger


def crf_now(crf: np.ndarray, last: np.ndarray, step: int) -> np.ndarray:
    """`AccessStats.crf` carried from `last` to `step` (never-requested experts have crf 0: 0 at every step)."""
    return crf * np.power(DECAY, step - last)


def recency_tiebreak(primary: np.ndarray, last: np.ndarray, step: int) -> np.ndarray:
    """`primary`, ties broken by recency: adds last/(step+2), which lies in (-1, 1) and keeps integer gaps."""
    return primary + last / (step + 2.0)


class Ranked:
    """Base of every policy: the engine-side `EvictionPolicy` over a subclass's `priority`.

    Subclasses define `priority(stats, step) -> array` (same shape as the stats; lowest is evicted). How the simulator
    drives a policy beyond ranking (offline, preloaded, misses run elsewhere) is the simulator's (trace/simulate.py
    DRIVES). `predict` makes every Ranked a ForecastConsumer; `uses_predictions` says whether `priority` reads
    `stats.prob` (only then is one handed to the prefetcher), `uses_crf` whether it reads `stats.crf` (only then does
    `on_access` keep it: it costs a power a key), `ranks_next_use` whether it wants next-token forecasts too. These are
    declared here, read where the run is built (runtime/builder.py), never probed.
    """

    uses_predictions = False
    uses_crf = False
    ranks_next_use = False
    """The prefetcher also hands it, once a layer has routed, that layer's forecast for the next token (PLEC)."""

    def __init__(self) -> None:
        self._index: dict[ExpertKey, int] = {}
        self._layer_index: dict[int, np.ndarray] = {}
        self.stats = AccessStats.zeros(0)

    def priority(self, stats: AccessStats, step: int) -> np.ndarray:
        raise NotImplementedError

    def _row(self, key: ExpertKey) -> int:
        i = self._index.get(key)
        if i is None:
            i = self._index[key] = len(self._index)
            if i >= len(self.stats.count):
                self.stats = self.stats.grown(2 * i + 16)
        return i

    def on_access(self, keys: Sequence[ExpertKey], step: int) -> None:
        index, crf = self._index, self.uses_crf
        for key in keys:  # a loop with no call per known key: this runs per layer and token
            i = index.get(key)
            if i is None:
                i = self._row(key)  # may grow the arrays, so they are looked up after it
            stats = self.stats
            if crf:  # touch(), without a call per key (Python floats: numpy scalars' ** costs more)
                stats.crf[i] = float(stats.crf[i]) * DECAY ** (step - int(stats.last[i])) + 1.0
            stats.count[i] += 1
            stats.last[i] = step

    def predict(self, layer: int, probs_E: np.ndarray) -> None:
        index = self._layer_index.get(layer)
        if index is None or len(index) != len(probs_E):
            index = self._layer_index[layer] = np.array([self._row(ExpertKey(layer, e)) for e in range(len(probs_E))])
        self.stats.prob[index] = probs_E  # after _row: it may have grown the arrays

    def score(self, key: ExpertKey, step: int) -> float:
        """`key`'s priority now (what `victim` compares)."""
        return float(self.priority(self.stats.take(np.array([self._row(key)])), step)[0])

    def victims(self, candidates: Collection[ExpertKey], count: int, step: int) -> list[ExpertKey]:
        """The `count` lowest priorities, ties to the lower key: a priority is a function of the expert's own
        statistics, which an eviction leaves alone, so this is what `count` calls of `victim` in a row return."""
        keys = sorted(candidates)
        rows = list(map(self._index.get, keys))
        if None in rows:  # never accessed (e.g. loaded at warm start): give it its row now
            rows = [self._row(k) for k in keys]
        priority = self.priority(self.stats.take(np.array(rows)), step)
        if count == 1:
            return [keys[int(np.argmin(priority))]]
        return list(map(keys.__getitem__, np.argsort(priority, kind="stable")[:count].tolist()))

    def victim(self, candidates: Collection[ExpertKey], step: int) -> ExpertKey:
        """The one candidate to evict now."""
        return self.victims(candidates, 1, step)[0]
