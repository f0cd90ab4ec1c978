"""What every architecture file provides: its `build`, joined with its checkpoint spec (models/specs.py: config parsing
and expert tensor names) into an `Architecture`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from moepager.experts.executor import ExpertExecutor
from moepager.models.backend import Backend
from moepager.models.config import ModelConfig
from moepager.models.layers import CausalLM
from moepager.models.naming import ExpertNaming
from moepager.models.specs import ArchSpec


class BuildModel(Protocol):
    def __call__(self, cfg: ModelConfig, experts: ExpertExecutor, backend: Backend | None = None) -> CausalLM:
        """The model's modules (empty weights) around `experts`, every block computing with `backend` (None: torch's
        ops alone)."""
        ...


@dataclass(frozen=True)
class Architecture:
    """One supported HF architecture: its checkpoint spec (how to read its config and name its expert tensors:
    models/specs.py) and how to build it."""

    spec: ArchSpec
    build: BuildModel

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def parse_config(self) -> Callable[[Mapping[str, Any]], ModelConfig]:
        return self.spec.parse_config

    @property
    def expert_naming(self) -> ExpertNaming:
        return self.spec.expert_naming
