"""What the expert store is made of and hands out (store/store.py): its tiers (a slot table over an arena), the
experts a layer holds pinned on the device or in the host tier, and the readers that fill a slot from disk."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, Protocol

import torch

from moepager.store.slots import P, SlotTable
from moepager.types import Between, ExpertKey


class ReadExperts(Protocol):
    def __call__(self, keys: Sequence[ExpertKey], outs: Sequence[torch.Tensor], between: Between | None = None) -> int:
        """Fill several flat CPU buffers with experts that lie together on disk, in one read; returns the bytes."""
        ...


class ReadExpert(Protocol):
    def __call__(self, key: ExpertKey, out_flat: torch.Tensor, between: Between | None = None) -> int:
        """Fill a flat CPU buffer with an expert from disk, calling `between` between the read's chunks; returns
        the bytes read."""
        ...


Ticket = Future[torch.cuda.Event | None]


class Tier(Generic[P]):
    """A slot table plus its arena: `buffers[slot]` is one expert's flat buffer."""

    def __init__(self, table: SlotTable[P], buffers: torch.Tensor):
        self.table = table
        self.buffers = buffers

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's buffer (whatever its format: the store only moves bytes)."""
        return self.buffers[0].numel() * self.buffers.element_size()


@dataclass
class Held:
    """A layer's experts pinned by `acquire`: their device slots (or stream rows), in the order asked for."""

    layer: int
    experts: Sequence[int]
    slots: list[int]
    """Each expert's slot or stream row; -1 while it waits for a stream row, and once its row moved on."""
    ready: list[int]
    """Indices whose expert was resident or had landed when acquired (a landed load's result already claimed:
    computing with them needs no wait)."""
    pending: list[int]
    """Indices still loading when acquired (stream rows included)."""
    queued: list[int]
    """Indices waiting for a stream row (`recycle` starts them)."""
    streaming: int = 0
    """Indices in stream rows now (nothing for `recycle` to do when 0)."""


@dataclass
class HostHeld:
    """A layer's experts pinned in the host tier by `HostCompute.acquire`, to be computed there (hybrid execution)."""

    layer: int
    slots: list[int]
    """Each expert's host slot, in the order asked for."""
    reads: list[Ticket | None]
    """Each expert's read from disk into its slot when it was not there (None: it was): wait before computing."""
