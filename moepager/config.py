"""Frozen, validated configuration of an engine run. Environment variables are read here, once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from moepager.errors import MoepagerError


def default_cache_dir() -> Path:
    """$MOEPAGER_CACHE, else $XDG_CACHE_HOME/moepager, else ~/.cache/moepager."""
    if os.environ.get("MOEPAGER_CACHE"):
        return Path(os.environ["MOEPAGER_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moepager"


@dataclass(frozen=True)
class EngineConfig:
    """What to run and where."""

    model: str | None = None
    """Checkpoint directory; None runs the built-in default model."""
    dtype: str | None = None
    """Compute dtype (bfloat16, float16, float32); None keeps the checkpoint's."""
    device: str = "cpu"
    """Where the model computes: cpu or cuda[:N]."""
    threads: int | None = None
    """CPU threads for torch; None keeps torch's default."""
    cache_dir: Path = field(default_factory=default_cache_dir)
    """Where the default model is created on first use."""

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise MoepagerError(f"--threads must be >= 1, got {self.threads}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise MoepagerError(f"device '{self.device}' is not supported; use cpu or cuda[:N]")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise MoepagerError(f"device '{self.device}' requested but CUDA is not available")
