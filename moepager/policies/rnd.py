"""Random replacement (the RND baseline of MoEpic Table 1): evict a uniformly random candidate, seeded."""

from __future__ import annotations

import random
from collections.abc import Collection

from moepager.types import ExpertKey


class RND:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def on_access(self, key: ExpertKey, step: int) -> None:
        return None

    def victim(self, candidates: Collection[ExpertKey], step: int) -> ExpertKey:
        return self._rng.choice(sorted(candidates))  # sorted: the same seed gives the same victims
