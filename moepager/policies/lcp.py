"""LCP, "least cache priority" (MoEpic §2.4, eq. 4): evict the lowest P = mu * rho^(nu / omega).

mu is how many times the expert was activated, nu how many steps (tokens, in decode) since its last
activation; omega = 128 and rho = 0.25 (the paper's defaults) cut the priority of an expert idle for 128
tokens by 4x. It mixes LFU (mu) with LRU (the decay). Never-activated experts have P = 0 and go first.
"""

from __future__ import annotations

import numpy as np

from moepager.policies.base import AccessStats, Ranked


class LCP(Ranked):
    def __init__(self, omega: float = 128.0, rho: float = 0.25) -> None:
        super().__init__()
        self.omega, self.rho = omega, rho

    def priority(self, stats: AccessStats, step: int) -> np.ndarray:
        return stats.count * np.power(self.rho, (step - stats.last) / self.omega)
