"""Protocols of where expert weights come from: a reader that fills flat buffers, and the one-expert-at-a-time
source that the slow reference `combine_experts` (experts/reference.py) reads.

A source hands out the experts a layer routed to, in the fixed order their outputs are summed in, each valid
until the next is requested. Both executors (experts/executor.py) are sources too, so tests can compare the
fast path with the reference on the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from moepager.experts.weights import ExpertShape, ExpertWeights
from moepager.types import Between, ExpertKey


class FlatReader(Protocol):
    """Anything that fills an expert's flat buffer from storage (checkpoints/expert_reader.py reads checkpoints)."""

    shape: ExpertShape

    def read(self, key: ExpertKey, out_flat: torch.Tensor, between: Between | None = None) -> int:
        """Fill `out_flat`, calling `between` between the read's chunks; returns the bytes read."""
        ...


class ExpertSource(Protocol):
    def stream(self, layer: int, experts: Sequence[int]) -> Iterator[ExpertWeights]:
        """Weights of `experts` of `layer`, in that order; each valid until the next one is requested."""
        ...
