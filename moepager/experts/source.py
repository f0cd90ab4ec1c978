"""The seam between the MoE block and wherever expert weights live.

A MoE layer asks its `ExpertSource` for the experts it routed to, in the fixed order their outputs are
summed in, and computes with each one before asking for the next. The source guarantees each expert's
weights stay valid until then (an expert in use is never evicted). `ResidentExperts` keeps every expert in
memory; `PagedExperts` pages them through the expert store under a budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from moepager.experts.weights import ExpertShape, ExpertWeights
from moepager.store.store import ExpertStore
from moepager.types import ExpertKey


class ExpertReader(Protocol):
    """Anything that fills an expert's flat buffer from storage (models/expert_reader.py reads checkpoints)."""

    shape: ExpertShape

    def read(self, key: ExpertKey, out_flat: torch.Tensor) -> int: ...


class ExpertSource(Protocol):
    def stream(self, layer: int, experts: Sequence[int]) -> Iterator[ExpertWeights]:
        """Weights of `experts` of `layer`, in that order; each valid until the next one is requested."""
        ...


class ResidentExperts:
    """Every routed expert read once into its own flat buffer on `device` (the all-resident baseline)."""

    def __init__(self, reader: ExpertReader, moe_layers: Sequence[int], num_experts: int,
                 device: torch.device | str = "cpu", progress: Callable[[int], None] | None = None):
        shape: ExpertShape = reader.shape
        self._weights: dict[ExpertKey, ExpertWeights] = {}
        staging = ExpertWeights.empty(shape) if torch.device(device).type != "cpu" else None
        for layer in moe_layers:
            for e in range(num_experts):
                key = ExpertKey(layer, e)
                w = ExpertWeights.empty(shape, device)
                if staging is None:
                    reader.read(key, w.buffer)
                else:
                    reader.read(key, staging.buffer)
                    w.buffer.copy_(staging.buffer)
                self._weights[key] = w
                if progress is not None:
                    progress(shape.nbytes)

    def stream(self, layer: int, experts: Sequence[int]) -> Iterator[ExpertWeights]:
        for e in experts:
            yield self._weights[ExpertKey(layer, e)]


class PagedExperts:
    """The expert store's device slots seen as expert weights (one view per slot, made once)."""

    def __init__(self, store: ExpertStore, shape: ExpertShape):
        self.store = store
        self._views = [ExpertWeights(buffer, shape) for buffer in store.device.buffers]

    def stream(self, layer: int, experts: Sequence[int]) -> Iterator[ExpertWeights]:
        for slot in self.store.stream(layer, experts):
            yield self._views[slot]
