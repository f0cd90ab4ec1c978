"""LCP, "least cache priority" (MoEpic §2.4, eq. 4): evict the lowest P = mu * rho^(nu / omega).

mu is how many times the expert was activated, nu how many steps (tokens, in decode) since its last
activation; omega = 128 and rho = 0.25 (the paper's defaults) cut the priority of an expert idle for 128
tokens by 4x. It mixes LFU (mu) with LRU (the decay). Never-activated experts have P = 0 and go first.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

from moepager.types import ExpertKey


class LCP:
    def __init__(self, omega: float = 128.0, rho: float = 0.25) -> None:
        self.omega, self.rho = omega, rho
        self._mu: dict[ExpertKey, int] = defaultdict(int)
        self._last: dict[ExpertKey, int] = {}

    def on_access(self, key: ExpertKey, step: int) -> None:
        self._mu[key] += 1
        self._last[key] = step

    def priority(self, key: ExpertKey, step: int) -> float:
        mu = self._mu.get(key, 0)
        return mu * self.rho ** ((step - self._last[key]) / self.omega) if mu else 0.0

    def victim(self, candidates: Collection[ExpertKey], step: int) -> ExpertKey:
        return min(candidates, key=lambda k: (self.priority(k, step), k))
