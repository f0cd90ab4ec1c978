"""Least recently used: evict the candidate whose last access is oldest (ties: lowest layer, then id)."""

from __future__ import annotations

from collections.abc import Collection

from moepager.types import ExpertKey


class LRU:
    def __init__(self) -> None:
        self._last: dict[ExpertKey, int] = {}

    def on_access(self, key: ExpertKey, step: int) -> None:
        self._last[key] = step

    def victim(self, candidates: Collection[ExpertKey], step: int) -> ExpertKey:
        return min(candidates, key=lambda k: (self._last.get(k, -1), k))
