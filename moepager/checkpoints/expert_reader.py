"""Reads one expert at a time from a checkpoint, in either layout transformers writes.

- per-expert (the Hub format): three 2-D tensors per expert, named by the architecture's templates;
- fused: `gate_up_proj [E, 2F, D]` and `down_proj [E, H, F]` per layer, from which row `e` is read alone.
The layout is detected from the names present, per checkpoint. An expert's pieces are read in place from
the safetensors files (`checkpoints/disk.py`: O_DIRECT, no page cache) straight into its flat buffer
`[gate 2F x D rows | down D x F]`; only a dtype conversion goes through a per-thread scratch buffer.

Quantized runs (experts/quant.py): a float checkpoint's expert is read into a per-thread float buffer and
quantized into the slot; a quantized checkpoint (`moepager quantize`, checkpoints/quantized.py) stores each
projection's integers, scales and zeros per expert, read into per-thread scratch and laid out for the kernel
(int8: copied; int4: repacked for the CPU kernel), or dequantized when the run asks for float experts.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from moepager.checkpoints.derived import SplitLayout
from moepager.checkpoints.disk import DiskFiles, Span, bounce_bytes
from moepager.checkpoints.safetensors import Checkpoint, TensorLocation
from moepager.config import DirectIO
from moepager.errors import CheckpointError
from moepager.experts.quant import (
    QuantFormat,
    QuantizedProjection,
    dequantize_projection,
    projection_tensors,
    quantize_expert,
)
from moepager.experts.weights import ExpertShape, ExpertWeights, expert_view
from moepager.models.naming import ExpertNaming
from moepager.types import Between, ExpertKey


def is_routed_expert(name: str) -> bool:
    """Whether a stored tensor holds routed-expert weights, in every supported architecture's naming (shared
    experts are `shared_expert(s).`, so they do not match)."""
    return ".experts." in name


class ExpertLayout(Enum):
    PER_EXPERT = "per-expert"
    FUSED = "fused"


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one stored tensor that fills elements [start, start + numel) of the flat buffer."""

    path: Path
    offset: int
    dtype: torch.dtype
    start: int
    numel: int


class ExpertReader:
    """Reads expert (layer, e) from `checkpoint` into a preallocated flat buffer, converting dtype."""

    def __init__(self, checkpoint: Checkpoint, naming: ExpertNaming, shape: ExpertShape, first_moe_layer: int,
                 direct: DirectIO = "auto", stored: QuantFormat | None = None, split: SplitLayout | None = None):
        self.checkpoint = checkpoint
        self.naming = naming
        self.shape = shape
        self.stored = stored
        """The quantized format the checkpoint holds its experts in (None: float)."""
        self.layout = self._detect(first_moe_layer) if stored is None else ExpertLayout.PER_EXPERT
        if stored is not None:
            self.checkpoint.location(naming.gate.format(layer=first_moe_layer, expert=0) + "_scale")
        self.direct = direct
        self.files = DiskFiles(direct, bounce_bytes(shape.nbytes))
        self._local = threading.local()
        self._first = ExpertKey(first_moe_layer, 0)
        self.split = split
        """A split checkpoint's layout (checkpoints/split.py): the experts read are its parts."""

    def buffer_bytes_per_thread(self) -> int:
        """Memory each reading thread allocates besides the expert slots: the O_DIRECT bounce buffer, plus a
        whole expert in the stored dtype when it must be converted."""
        bounce = self.files.bounce_nbytes if self.direct != "off" else 0
        if self.stored is not None:
            d, f = self.shape.hidden, self.shape.intermediate
            scratch = sum(dt.itemsize * math.prod(shape) for n, k in ((2 * f, d), (d, f))
                          for _, dt, shape in projection_tensors(self.stored, n, k, self.shape.dtype))
            return bounce + scratch + (self.shape.float_shape.nbytes if self.shape.quant is None else 0)
        stored = {p.dtype for p in self.pieces(self._first)}
        numel = self.shape.float_shape.numel
        convert = numel * max(d.itemsize for d in stored) if stored != {self.shape.dtype} else 0
        return bounce + convert + (self.shape.float_shape.nbytes if self.shape.quant is not None else 0)

    def _detect(self, layer: int) -> ExpertLayout:
        if self.checkpoint.has(self.naming.fused_gate_up.format(layer=layer)):
            return ExpertLayout.FUSED
        if self.checkpoint.has(self.naming.gate.format(layer=layer, expert=0)):
            return ExpertLayout.PER_EXPERT
        raise CheckpointError(f"no expert weights found for layer {layer}: expected "
                              f"'{self.naming.gate.format(layer=layer, expert=0)}' or "
                              f"'{self.naming.fused_gate_up.format(layer=layer)}'")

    def pieces(self, key: ExpertKey) -> list[Piece]:
        """Where each part of the expert's flat buffer is stored."""
        layer, e = key
        d, f = self.shape.hidden, self.shape.intermediate
        if self.layout is ExpertLayout.FUSED:
            return [self._row_piece(self.naming.fused_gate_up.format(layer=layer), e, (2 * f, d), 0),
                    self._row_piece(self.naming.fused_down.format(layer=layer), e, (d, f), 2 * f * d)]
        names = [getattr(self.naming, k).format(layer=layer, expert=e) for k in ("gate", "up", "down")]
        shapes = [(f, d), (f, d), (d, f)]
        return [self._whole_piece(n, s, start) for n, s, start in zip(names, shapes, (0, f * d, 2 * f * d))]

    def _whole_piece(self, name: str, shape: tuple[int, int], start: int) -> Piece:
        loc = self.checkpoint.location(name)
        if loc.shape != shape:
            raise CheckpointError(f"tensor '{name}' has shape {list(loc.shape)} but config.json implies {list(shape)}")
        return Piece(loc.path, loc.offset, loc.dtype, start, shape[0] * shape[1])

    def _row_piece(self, name: str, row: int, shape: tuple[int, int], start: int) -> Piece:
        loc: TensorLocation = self.checkpoint.location(name)
        if len(loc.shape) != 3 or loc.shape[1:] != shape or loc.shape[0] <= row:
            raise CheckpointError(f"tensor '{name}' has shape {list(loc.shape)}, which does not hold row {row} of "
                                  f"{list(shape)}")
        numel = shape[0] * shape[1]
        return Piece(loc.path, loc.offset + row * numel * loc.dtype.itemsize, loc.dtype, start, numel)

    def read(self, key: ExpertKey, out_flat: torch.Tensor, between: Between | None = None) -> int:
        """Fill `out_flat` (1-D, the shape's buffer dtype, CPU) with the expert, calling `between` between the
        chunks of the read (a prefetch gives way to demand loads there); returns bytes read from disk."""
        if self.stored is not None:
            gate_up, down, nbytes = self._read_quantized(key, between)
            if self.shape.quant is None:
                w = ExpertWeights(out_flat, self.shape)
                w.gate_up_2FD.copy_(dequantize_projection(gate_up, self.stored))
                w.down_DF.copy_(dequantize_projection(down, self.stored))
            else:
                expert_view(out_flat, self.shape).store(gate_up, down)
            return nbytes
        if self.shape.quant is None:
            return self._read_float(key, out_flat, between)
        scratch = self._float_scratch()
        nbytes = self._read_float(key, scratch.buffer, between)
        quantize_expert(scratch.gate_up_2FD, scratch.down_DF, expert_view(out_flat, self.shape), self.shape.dtype)
        return nbytes

    def read_many(self, keys: Sequence[ExpertKey], outs: Sequence[torch.Tensor], between: Between | None = None) -> int:
        """`read` of several experts in one disk read where they lie together (a split checkpoint's consecutive parts
        of one expert: checkpoints/split.py), when their bytes need no conversion; else one by one."""
        pieces = [(p, out) for key, out in zip(keys, outs) for p in self.pieces(key)] \
            if self.stored is None and self.shape.quant is None else []
        if not pieces or any(p.dtype != out.dtype for p, out in pieces):
            return sum(self.read(key, out, between) for key, out in zip(keys, outs))
        return self.files.read([Span(p.path, p.offset, out[p.start: p.start + p.numel].view(torch.uint8))
                                for p, out in pieces], between)

    def _read_float(self, key: ExpertKey, out_flat: torch.Tensor, between: Between | None) -> int:
        spans, converts = [], []
        for p in self.pieces(key):
            dest = out_flat[p.start: p.start + p.numel]
            if p.dtype == out_flat.dtype:
                spans.append(Span(p.path, p.offset, dest.view(torch.uint8)))
            else:
                tmp = self._scratch(p.dtype)[p.start: p.start + p.numel]
                spans.append(Span(p.path, p.offset, tmp.view(torch.uint8)))
                converts.append((dest, tmp))
        nbytes = self.files.read(spans, between)
        for dest, tmp in converts:
            dest.copy_(tmp)
        return nbytes

    def _scratch(self, dtype: torch.dtype) -> torch.Tensor:
        """This thread's buffer for one expert in the stored dtype (only when converting)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        if dtype not in bufs:
            bufs[dtype] = torch.empty(self.shape.float_shape.numel, dtype=dtype)
        return bufs[dtype]

    def _float_scratch(self) -> ExpertWeights:
        """This thread's float expert, quantized into the slot after each read."""
        w = getattr(self._local, "float_expert", None)
        if w is None:
            w = self._local.float_expert = ExpertWeights.empty(self.shape.float_shape)
        return w

    def _quant_scratch(self) -> tuple[QuantizedProjection, QuantizedProjection]:
        """This thread's (gate_up, down) in checkpoint form: rows of gate then up, as stored per expert."""
        parts = getattr(self._local, "quant", None)
        if parts is None:
            d, f = self.shape.hidden, self.shape.intermediate
            parts = self._local.quant = (QuantizedProjection.empty(self.stored, 2 * f, d, self.shape.dtype),
                                         QuantizedProjection.empty(self.stored, d, f, self.shape.dtype))
        return parts

    def _read_quantized(self, key: ExpertKey, between: Between | None
                        ) -> tuple[QuantizedProjection, QuantizedProjection, int]:
        """The expert's projections from a quantized checkpoint: integers, scales and zeros, gate rows then up."""
        layer, e = key
        gate_up, down = self._quant_scratch()
        spans, converts = [], []
        for proj, names in ((gate_up, (self.naming.gate, self.naming.up)), (down, (self.naming.down,))):
            for suffix in ("", "_scale", "_zero"):
                dest = proj.tensor(suffix)
                if dest is None:
                    continue
                row = 0
                for template in names:
                    name = template.format(layer=layer, expert=e) + suffix
                    loc = self.checkpoint.location(name)
                    part = dest[row: row + (loc.shape[0] if loc.shape else 0)]
                    if loc.shape != tuple(part.shape):
                        raise CheckpointError(f"tensor '{name}' has shape {list(loc.shape)}; the checkpoint's "
                                              f"quantization_config implies {list(part.shape)}")
                    row += loc.shape[0]
                    if loc.dtype == part.dtype:
                        spans.append(Span(loc.path, loc.offset, part.view(-1).view(torch.uint8)))
                    else:
                        tmp = torch.empty(loc.shape, dtype=loc.dtype)
                        spans.append(Span(loc.path, loc.offset, tmp.view(-1).view(torch.uint8)))
                        converts.append((part, tmp))
        nbytes = self.files.read(spans, between)
        for dest, tmp in converts:
            dest.copy_(tmp)
        return gate_up, down, nbytes
