"""Least frequently used: evict the candidate requested fewest times so far (ties: least recent, then key).

Counts persist while an expert is out of the cache (frequency is a property of the workload, not of the
cache's contents), as in the LFU baselines of MoEpic and SMoE.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

from moepager.types import ExpertKey


class LFU:
    def __init__(self) -> None:
        self._count: dict[ExpertKey, int] = defaultdict(int)
        self._last: dict[ExpertKey, int] = {}

    def on_access(self, key: ExpertKey, step: int) -> None:
        self._count[key] += 1
        self._last[key] = step

    def victim(self, candidates: Collection[ExpertKey], step: int) -> ExpertKey:
        return min(candidates, key=lambda k: (self._count.get(k, 0), self._last.get(k, -1), k))
