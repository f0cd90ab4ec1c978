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

from moepager.experts.sorting import SortedTokens
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


class FusedKernel(Protocol):
    """A layer's experts computed in one call (accel/cpu_kernels.py's `FusedExperts`, handed to the executors by the
    composition root): resident layers in one call, paged ones as their experts land, then combined. Both orders
    give the same bits."""

    max_tokens: int
    """Layer calls on more tokens than this go to the executor's own kernels."""
    note: str
    """What a run reports beside the experts' format: this kernel, and how it computes when that is lossier."""

    def resident(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor, arena: torch.Tensor,
                 base: int, count: int) -> torch.Tensor: ...

    def rows(self, work: SortedTokens, rows: Sequence[int], which: Sequence[int], y_MD: torch.Tensor, *,
             x_ND: torch.Tensor, w_M: torch.Tensor, arena: torch.Tensor) -> None:
        """Experts `which` (indices into work.experts, at arena rows rows[i]) into their weighted fp32 rows of y_MD
        (the paged executor's signature for computing a batch of landed experts)."""
        ...

    def combine(self, y_MD: torch.Tensor, token_M: torch.Tensor, n: int) -> torch.Tensor: ...
