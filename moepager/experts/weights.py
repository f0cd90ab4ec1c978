"""One expert's weights in one flat buffer (mixtral-offloading style), with views for each projection.

Layout of a float buffer (elements): [gate_up: 2F x D | down: D x F]. gate rows come before up rows, exactly as
transformers' fused `gate_up_proj[e]`, so one matmul computes both and a fused checkpoint row is copied in
with a single read. A quantized expert's buffer is bytes: integer weights, then scales (experts/quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moepager.experts.quant import QuantExpertWeights, QuantFormat, sections


@dataclass(frozen=True)
class ExpertShape:
    """Geometry of one routed expert, and the format its weights are held in."""

    hidden: int
    """D."""
    intermediate: int
    """F."""
    dtype: torch.dtype
    """The run's compute dtype: float weights' dtype, or the dtype of a quantized expert's scales."""
    quant: QuantFormat | None = None
    """None: float weights in `dtype`; otherwise int8/int4 (opt-in, lossy)."""

    @property
    def buffer_dtype(self) -> torch.dtype:
        """Element type of the flat buffer: `dtype`, or bytes for a quantized expert."""
        return self.dtype if self.quant is None else torch.uint8

    @property
    def numel(self) -> int:
        """Elements of the flat buffer."""
        if self.quant is None:
            return 3 * self.hidden * self.intermediate
        return sections(self.hidden, self.intermediate, self.dtype, self.quant)[1]

    @property
    def nbytes(self) -> int:
        return self.numel * self.buffer_dtype.itemsize

    @property
    def float_shape(self) -> ExpertShape:
        """The same expert in float weights of the run's dtype (what a float checkpoint is read into)."""
        return ExpertShape(self.hidden, self.intermediate, self.dtype)

    @property
    def format_name(self) -> str:
        return self.quant.name if self.quant is not None else str(self.dtype).removeprefix("torch.")


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

    def gate_up(self, x_TD: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x_TD, self.gate_up_2FD)

    def down(self, x_TF: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x_TF, self.down_DF)

    @classmethod
    def empty(cls, shape: ExpertShape, device: torch.device | str = "cpu", pin_memory: bool = False) -> ExpertWeights:
        return cls(torch.empty(shape.numel, dtype=shape.dtype, device=device, pin_memory=pin_memory), shape)


AnyExpertWeights = ExpertWeights | QuantExpertWeights


def expert_view(buffer: torch.Tensor, shape: ExpertShape) -> AnyExpertWeights:
    """The right views for the shape's format over one flat buffer."""
    if shape.quant is None:
        return ExpertWeights(buffer, shape)
    return QuantExpertWeights(buffer, shape.hidden, shape.intermediate, shape.dtype, shape.quant)
