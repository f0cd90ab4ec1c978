"""One KV cache per engine, preallocated and reused by every call instead of allocated per call.

The cache is allocated at the first call's size and grown when a call needs more rows or positions (positions
at least double, up to the model's context, so a run of growing prompts allocates O(log) times); a call gets
views of its first rows and positions. Nothing needs clearing between calls: a row's attention reads only the
positions its own tokens wrote in this call (positions are cache indices, and masks or the KV length stop every
read at the row's own position).
"""

from __future__ import annotations

import torch

from moepager.models.layers import CausalLM

Cache = list[tuple[torch.Tensor, ...]]


class KVCachePool:
    def __init__(self, model: CausalLM, dtype: torch.dtype, device: torch.device):
        self.model, self.dtype, self.device = model, dtype, device
        self.rows = self.length = 0
        self.allocations = 0
        """How many times the cache was (re)allocated."""
        self._cache: Cache | None = None

    def get(self, rows: int, length: int) -> Cache:
        """Views of the cache for `rows` rows of `length` positions."""
        if self._cache is None or rows > self.rows or length > self.length:
            context = self.model.config.max_position_embeddings
            self.rows = max(rows, self.rows)
            self.length = max(length, min(2 * self.length, context))
            self._cache = None  # let the old one go before the new one is allocated
            self._cache = self.model.make_cache(self.rows, self.length, self.dtype, self.device)
            self.allocations += 1
        return [tuple(t[:rows, :, :length] for t in layer) for layer in self._cache]
