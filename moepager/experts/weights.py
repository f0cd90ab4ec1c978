"""One expert's weights in one flat buffer (mixtral-offloading style), with views for each projection.

Layout of the buffer (elements): [gate_up: 2F x D | down: D x F]. gate rows come before up rows, exactly as
transformers' fused `gate_up_proj[e]`, so one matmul computes both and a fused checkpoint row is copied in
with a single read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertShape:
    """Geometry of one routed expert."""

    hidden: int
    """D."""
    intermediate: int
    """F."""
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class ExpertWeights:
    """Views `gate_up_2FD` and `down_DF` into one flat buffer; the buffer may be reused for another expert."""

    __slots__ = ("buffer", "gate_up_2FD", "down_DF")

    def __init__(self, buffer: torch.Tensor, shape: ExpertShape):
        if buffer.numel() != shape.numel or buffer.dtype != shape.dtype or buffer.dim() != 1:
            raise ValueError(f"expert buffer must be 1-D {shape.dtype} of {shape.numel} elements")
        d, f = shape.hidden, shape.intermediate
        self.buffer = buffer
        self.gate_up_2FD = buffer[: 2 * f * d].view(2 * f, d)
        self.down_DF = buffer[2 * f * d:].view(d, f)

    @classmethod
    def empty(cls, shape: ExpertShape, device: torch.device | str = "cpu", pin_memory: bool = False) -> ExpertWeights:
        return cls(torch.empty(shape.numel, dtype=shape.dtype, device=device, pin_memory=pin_memory), shape)
