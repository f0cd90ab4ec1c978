"""SMoE cache updates (SMoE §2.7): LFU victims, the cache changed by token-wise prefetch, misses run on the CPU.

After each token, a predictor ranks the experts the next token will use at each layer. Fixed-N walks down
that ranking skipping cached experts and loads exactly N (N transfers per layer per token, a steady PCIe
load); Adaptive loads only those of the top N that are not cached (0..N). Each load replaces the cached
expert with the fewest activations (LFU, ties least recent). A miss is computed on the CPU and never
admitted (the simulator drives it so: trace/simulate.py DRIVES). Defaults: N = 2 (the paper's best for DeepSeek-V3).
"""

from __future__ import annotations

import numpy as np

from moepager.policies.base import AccessStats, Ranked, recency_tiebreak


class SMoE(Ranked):
    def __init__(self, n: int = 2, adaptive: bool = False) -> None:
        super().__init__()
        if n < 1:
            raise ValueError(f"SMoE prefetch number must be at least 1, got {n}")
        self.n, self.adaptive = n, adaptive

    def priority(self, stats: AccessStats, step: int) -> np.ndarray:
        return recency_tiebreak(stats.count.astype(np.float64), stats.last, step)

    def admissions(self, ranked_LR: np.ndarray, cached_LE: np.ndarray) -> np.ndarray:
        """Which experts to load for the next token: bool `[L, E]` from a ranking `[L, R]` (best first, -1 pad)."""
        valid_LR = ranked_LR >= 0
        rows_L1 = np.arange(len(ranked_LR))[:, None]
        absent_LR = valid_LR & ~cached_LE[rows_L1, np.maximum(ranked_LR, 0)]
        if self.adaptive:
            chosen_LR = absent_LR & (np.arange(ranked_LR.shape[1]) < self.n)
        else:
            chosen_LR = absent_LR & (np.cumsum(absent_LR, axis=1) <= self.n)
        load_LE = np.zeros_like(cached_LE)
        load_LE[np.broadcast_to(rows_L1, ranked_LR.shape)[chosen_LR], ranked_LR[chosen_LR]] = True
        return load_LE
