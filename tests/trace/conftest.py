"""Tiny traces written by the tests themselves."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moepager.trace.format import DECODE, MISSING, PREFILL, TraceHeader, TraceRequest, TraceWriter


def random_trace(path: Path, *, layers: int = 3, experts: int = 8, top_k: int = 2, lengths=(20, 15, 25),
                 prefill: int = 4, seed: int = 0, skew: float = 1.2, missing: float = 0.0) -> Path:
    """Requests with Zipf-ish routing (so caches have something to find), some prefill, optional gaps."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1) ** skew
    header = TraceHeader("tiny", tuple(range(1, layers + 1)), experts, top_k, expert_bytes=1 << 20)
    with TraceWriter(path, header) as w:
        for r, t in enumerate(lengths):
            ids = np.empty((t, layers, top_k), np.int16)
            for i in range(t):
                for layer in range(layers):
                    p = np.roll(weights, layer + r)
                    ids[i, layer] = rng.choice(experts, top_k, replace=False, p=p / p.sum())
            if missing:
                ids[rng.random((t, layers)) < missing] = MISSING
            phase = np.full(t, DECODE, np.uint8)
            phase[:prefill] = PREFILL
            w.add(TraceRequest(ids, phase, name=f"r{r}"))
    return path
