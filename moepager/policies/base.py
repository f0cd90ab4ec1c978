"""The eviction-policy seam: a policy ranks candidates; the cache that asks owns the data and invariants.

The store only ever offers experts it may evict (not in use, not loading), so a policy never has to know
about pins, buffers or tiers. `step` is the cache's clock: one tick per forward pass (in decode, one token).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from moepager.types import ExpertKey


class EvictionPolicy(Protocol):
    def on_access(self, key: ExpertKey, step: int) -> None:
        """`key` was requested at `step` (hit or miss)."""
        ...

    def victim(self, candidates: Collection[ExpertKey], step: int) -> ExpertKey:
        """Which of `candidates` (non-empty, all evictable) to evict now."""
        ...
