"""OD-MoE's KV alignment (§2.5): the main rank's full-precision KV cache entries overwrite the shadow's own.

The shadow computes every pass on its int8 copy, so its KV cache drifts from the main rank's: its weights differ, and so
does its routing, and both change every later hidden state. Every `kv_align_period`-th pass (the paper's KV period,
whose default is 1; this engine's is 0, off: config.py `RemoteConfig.kv_align_period` says why) the main rank's feed
sends, with the pass it announces, the entries of every layer at the positions it computed since it last sent that
request's (`KVAligner.spans`; at the first decode pass after a prompt, the prompt's positions), and the shadow writes
them over its own (`write`) before it computes the pass: "late departure", since the entries exist only once the main
rank's previous pass is done. Only requests in the announced pass are aligned (the shadow computes those next); a
request the main rank computes again from an earlier position (preempted) starts its count again there. The entries of
all layers travel as one tensor [tokens, sum of the layers' entry sizes] in the main rank's cache dtype and are cast to
the shadow's.

Shape legend: P positions (tokens) aligned, S spans (request, start, count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from moepager.errors import MoepagerError
from moepager.types import KVCacheHolder, PassInfo

FORGET_AFTER = 1024
"""Passes after which a request no pass carried is forgotten (`KVAligner._prune`)."""

Span = tuple[int, int, int]
"""(request, start, count): a request's positions start .. start + count - 1."""


class KVPayload(NamedTuple):
    """What a due pass sends the shadow (`KVAligner.payload`)."""

    spans_S3: torch.Tensor
    """Each aligned span (request, start, count)."""
    entries_PX: torch.Tensor
    """Every layer's entries at those positions, side by side (`gather`)."""


def slots(blocks: Sequence[int], start: int, count: int, block_size: int) -> torch.Tensor:
    """Positions start .. start + count - 1 of a request holding `blocks` as indices into a layer's cache flattened to
    [blocks * block_size, ...]."""
    p = torch.arange(start, start + count)
    return torch.tensor(list(blocks), dtype=torch.long)[p // block_size] * block_size + p % block_size


def gather(cache: Sequence[torch.Tensor], slots_P: torch.Tensor) -> torch.Tensor:
    """Every layer's entries at those slots, side by side: [P, sum of the layers' entry sizes], on the host."""
    parts = []
    for layer in cache:
        flat = layer.view(-1, *layer.shape[2:])
        parts.append(flat[slots_P.to(layer.device)].flatten(1))
    return torch.cat(parts, 1).to("cpu").contiguous()


def write(cache: Sequence[torch.Tensor], slots_P: torch.Tensor, entries_PX: torch.Tensor) -> None:
    """`gather`'s inverse: each layer's share of the entries written at those slots, cast to the cache's dtype."""
    sizes = entry_sizes(cache)
    if entries_PX.shape != (len(slots_P), sum(sizes)):
        raise MoepagerError(f"KV alignment: {tuple(entries_PX.shape)} entries came for {len(slots_P)} positions of a "
                            f"cache whose entry holds {sum(sizes)} values: the main and shadow ranks run different "
                            "models")
    with torch.inference_mode():  # the cache was made in the runner's inference mode
        for layer, part in zip(cache, entries_PX.split(sizes, 1), strict=True):
            flat = layer.view(-1, *layer.shape[2:])
            flat[slots_P.to(layer.device)] = part.view(-1, *layer.shape[2:]).to(layer.device, layer.dtype)


def entry_sizes(cache: Sequence[torch.Tensor]) -> list[int]:
    """Values one position holds in each layer (`gather` puts them side by side in a row)."""
    return [layer[0, 0].numel() for layer in cache]


class KVAligner:
    """The main rank's side: which positions of each request the shadow has not yet been sent."""

    def __init__(self, period: int):
        if period < 1:
            raise MoepagerError(f"KV alignment needs a period of at least 1 pass, got {period}")
        self.period = period
        self.sent: dict[int, int] = {}
        """request -> positions 0 .. n - 1 sent (or never to be: computed before its count started)."""
        self.computed: dict[int, int] = {}
        """request -> positions the main rank had computed as of the passes announced before this one."""
        self.seen: dict[int, int] = {}
        """request -> the last pass that carried it."""
        self.positions = self.bytes = 0
        """Positions sent so far, and their bytes."""

    def spans(self, info: PassInfo) -> list[tuple[Span, Sequence[int]]]:
        """The pass's aligned spans with the blocks that hold them, and this pass's positions noted as computed (the
        next pass due sends them). A due pass: pass_id a multiple of the period."""
        due = info.pass_id % self.period == 0
        out = []
        for i, (request, start) in enumerate(zip(info.requests, info.starts, strict=True)):
            sent, computed = self.sent.get(request, 0), self.computed.get(request, 0)
            if start < sent:  # computed again from `start` (preempted): its later positions are not yet there
                sent = computed = start
            end = min(computed, start)
            if due and end > sent and info.blocks:
                out.append(((request, sent, end - sent), info.blocks[i]))
                sent = end
            self.sent[request] = sent
            self.computed[request] = max(computed, start + info.counts[i])
            self.seen[request] = info.pass_id
        if info.pass_id % FORGET_AFTER == FORGET_AFTER - 1:
            self._prune(info.pass_id)
        return out

    def payload(self, info: PassInfo, pool: KVCacheHolder) -> KVPayload | None:
        """The spans and entries of the pool's cache to send with the pass, or None when nothing is due."""
        spans = self.spans(info)
        if not spans:
            return None
        index = torch.cat([slots(blocks, start, count, pool.block_size) for (_, start, count), blocks in spans])
        entries = gather(pool.cache, index)
        self.positions += len(index)
        self.bytes += entries.numel() * entries.element_size()
        return KVPayload(torch.tensor([span for span, _ in spans], dtype=torch.long), entries)

    def _prune(self, pass_id: int) -> None:
        """Forget the requests no pass has carried for FORGET_AFTER passes (finished ones: the feed is not told of a
        finish). One that comes back after that is sent all its positions again at its next pass."""
        self.seen = {r: p for r, p in self.seen.items() if pass_id - p < FORGET_AFTER}
        self.sent = {r: n for r, n in self.sent.items() if r in self.seen}
        self.computed = {r: n for r, n in self.computed.items() if r in self.seen}
