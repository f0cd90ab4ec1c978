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
    """One supported HF architecture: how to read its config, build it, and name its expert tensors."""

    name: str
    parse_config: Callable[[Mapping[str, Any]], ModelConfig]
    build: BuildModel
    expert_naming: ExpertNaming

    @classmethod
    def of(cls, spec: ArchSpec, build: BuildModel) -> Architecture:
        """The architecture its checkpoint spec describes (models/specs.py), built by `build`."""
        return cls(spec.name, spec.parse_config, build, spec.expert_naming)
