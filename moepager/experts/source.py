"""The seam between the MoE block and wherever expert weights live.

The MoE block asks its `ExpertSource` for the experts one layer needs, computes, then releases them. The
source guarantees the weights stay valid between `acquire` and `release` (an expert in use is never
evicted). `ResidentExperts` keeps every expert in memory; the expert store pages them under a budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from moepager.experts.weights import ExpertShape, ExpertWeights
from moepager.types import ExpertKey


class ExpertReader(Protocol):
    """Anything that fills an expert's buffer from storage (models/expert_reader.py reads checkpoints)."""

    shape: ExpertShape

    def read(self, key: ExpertKey, out: ExpertWeights) -> None: ...


class ExpertSource(Protocol):
    def acquire(self, layer: int, experts: Sequence[int]) -> Sequence[ExpertWeights]:
        """Weights of `experts` of `layer`, in that order, valid until `release(layer)`."""
        ...

    def release(self, layer: int) -> None:
        """The layer's experts acquired last are no longer in use."""
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
                    reader.read(key, w)
                else:
                    reader.read(key, staging)
                    w.buffer.copy_(staging.buffer)
                self._weights[key] = w
                if progress is not None:
                    progress(shape.nbytes)

    def acquire(self, layer: int, experts: Sequence[int]) -> Sequence[ExpertWeights]:
        return [self._weights[ExpertKey(layer, e)] for e in experts]

    def release(self, layer: int) -> None:
        return None
