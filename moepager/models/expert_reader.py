"""Reads one expert at a time from a checkpoint, in either layout transformers writes.

- per-expert (the Hub format): three 2-D tensors per expert, named by the architecture's templates;
- fused: `gate_up_proj [E, 2F, D]` and `down_proj [E, H, F]` per layer, from which row `e` is read alone.
The layout is detected from the names present, per checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from moepager.errors import CheckpointError
from moepager.experts.weights import ExpertShape, ExpertWeights
from moepager.models.loader import Checkpoint
from moepager.types import ExpertKey


@dataclass(frozen=True)
class ExpertNaming:
    """An architecture's tensor names for routed experts; `{layer}` and `{expert}` are filled in."""

    gate: str
    up: str
    down: str
    fused_gate_up: str
    fused_down: str


class ExpertLayout(Enum):
    PER_EXPERT = "per-expert"
    FUSED = "fused"


class ExpertReader:
    """Reads expert (layer, e) from `checkpoint` into a preallocated `ExpertWeights`, converting dtype."""

    def __init__(self, checkpoint: Checkpoint, naming: ExpertNaming, shape: ExpertShape, first_moe_layer: int):
        self.checkpoint = checkpoint
        self.naming = naming
        self.shape = shape
        self.layout = self._detect(first_moe_layer)

    def _detect(self, layer: int) -> ExpertLayout:
        if self.checkpoint.has(self.naming.fused_gate_up.format(layer=layer)):
            return ExpertLayout.FUSED
        if self.checkpoint.has(self.naming.gate.format(layer=layer, expert=0)):
            return ExpertLayout.PER_EXPERT
        raise CheckpointError(f"no expert weights found for layer {layer}: expected "
                              f"'{self.naming.gate.format(layer=layer, expert=0)}' or "
                              f"'{self.naming.fused_gate_up.format(layer=layer)}'")

    def read(self, key: ExpertKey, out: ExpertWeights) -> None:
        layer, e = key
        f = self.shape.intermediate
        if self.layout is ExpertLayout.FUSED:
            self.checkpoint.read_row_into(self.naming.fused_gate_up.format(layer=layer), e, out.gate_up_2FD)
            self.checkpoint.read_row_into(self.naming.fused_down.format(layer=layer), e, out.down_DF)
            return
        names = {k: getattr(self.naming, k).format(layer=layer, expert=e) for k in ("gate", "up", "down")}
        self.checkpoint.read_exact_into(names["gate"], out.gate_up_2FD[:f])
        self.checkpoint.read_exact_into(names["up"], out.gate_up_2FD[f:])
        self.checkpoint.read_exact_into(names["down"], out.down_DF)
