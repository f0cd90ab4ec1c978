"""The engine's KV cache: fixed-size blocks from one preallocated pool, handed to requests and taken back.

Every layer's cache is one [num_blocks, block_size, Hc, C] tensor (keys and values side by side on the head axis;
models/attention.py reads a row's blocks through its block table). Block 0 is scratch: padding tokens write there
and padded block-table entries point there; attention masks every position a row has not written, so nothing
needs clearing when a block changes hands. The pool is allocated at first use and grows (only while no request
holds a block) when one request alone needs more.
"""

from __future__ import annotations

import math

import torch

from moepager.errors import BudgetError
from moepager.models.layers import CausalLM
from moepager.store.budget import ram_available

Cache = list[torch.Tensor]
SCRATCH = 0


class KVBlocks:
    """The pool's bookkeeping: which blocks are free, handed to requests and taken back (no cache tensors: what the
    simulator's stand-in of the scheduler reserves against, runtime/step_order.py)."""

    def __init__(self, num_tokens: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = math.ceil(num_tokens / block_size) + 1
        self.free: list[int] = list(range(self.num_blocks - 1, SCRATCH, -1))

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def reserve(self, blocks: list[int], tokens: int) -> bool:
        """Extend `blocks` to hold `tokens` positions; False (and nothing taken) when the pool is short."""
        need = self.blocks_for(tokens) - len(blocks)
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            blocks.append(self.free.pop())
        return True

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))
        blocks.clear()


def check_fits(model: CausalLM, dtype: torch.dtype, device: torch.device, num_tokens: int, block_size: int) -> None:
    """Refuse, before any allocation, a KV cache of `num_tokens` larger than the memory its device has free (a
    --kv-cache-tokens of 10^12 once ended in a MemoryError traceback). A block's bytes: the layers' cache shapes,
    made on the meta device."""
    need = model.cache_bytes(num_tokens, block_size, dtype)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = ram_available()[0]
    if need > free:
        raise BudgetError(f"--kv-cache-tokens {num_tokens}: the KV cache would take {need / 2**30:.2f} GiB, and "
                          f"{free / 2**30:.2f} GiB are free on the {device.type}; lower it")


class KVBlockPool(KVBlocks):
    def __init__(self, model: CausalLM, dtype: torch.dtype, device: torch.device, num_tokens: int, block_size: int):
        check_fits(model, dtype, device, num_tokens, block_size)
        super().__init__(num_tokens, block_size)
        self.model, self.dtype, self.device = model, dtype, device
        self.allocations = 0
        """How many times the cache was (re)allocated."""
        self._cache: Cache | None = None

    @property
    def cache(self) -> Cache:
        if self._cache is None:
            self._cache = self.model.make_cache(self.num_blocks, self.block_size, self.dtype, self.device)
            self.allocations += 1
        return self._cache

    def grow(self, tokens: int) -> None:
        """Make room for one request of `tokens` positions; only while every block is free."""
        if tokens <= self.capacity_tokens:
            return
        assert len(self.free) == self.num_blocks - 1, "the KV pool grows only while no request holds a block"
        context = self.model.config.max_position_embeddings
        self.num_blocks = self.blocks_for(max(tokens, min(2 * self.capacity_tokens, context))) + 1
        self.free = list(range(self.num_blocks - 1, SCRATCH, -1))
        self._cache = None  # let the old one go before the new one is allocated
