"""What every checkpoint moepager derives from another shares: the original's side files copied beside the new tensors,
and the marker of a split checkpoint (checkpoints/split.py), which the other writers refuse to take as an original."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moepager.atomic_io import atomic_dir
from moepager.checkpoints.safetensors import Checkpoint, write_shards
from moepager.errors import CheckpointError
from moepager.models.config import ModelConfig

SPLIT_KEY = "moepager_split"
PARTS = (2, 4, 8)
"""Parts an expert may be split into: θ moves in steps of 1/S (MoEpic's θ is continuous; 4 parts, the default,
give θ in quarters at 4 projections more per expert computed than whole)."""


def split_parts(config: dict[str, Any]) -> int:
    """How many parts the checkpoint with this config.json stores each routed expert in (1: not split)."""
    entry = config.get(SPLIT_KEY)
    if entry is None:
        return 1
    try:
        parts = int(entry["parts"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"config.json's '{SPLIT_KEY}' is {entry!r}; `moepager split` writes "
                              "{\"parts\": S}") from None
    if parts not in PARTS:
        raise CheckpointError(f"config.json says each expert is split in {parts} parts; moepager reads "
                              f"{', '.join(map(str, PARTS))}")
    return parts


def copy_side_files(checkpoint: Checkpoint, out: Path, note: str) -> None:
    """Copy what a derived checkpoint keeps of its original into `out` (tokenizer, generation config, chat
    template, ...; not its tensors nor its config), and the original's card under `note`, what this copy is."""
    for src in checkpoint.path.iterdir():
        if src.is_file() and src.suffix != ".safetensors" and src.name not in (
                "config.json", "model.safetensors.index.json", "README.md"):
            shutil.copy2(src, out / src.name)
    card = checkpoint.path / "README.md"
    if card.is_file():
        (out / "README.md").write_text(note + "\n\n" + card.read_text(encoding="utf-8"), encoding="utf-8")


def write_derived(checkpoint: Checkpoint, out_dir: Path, force: bool, entries: list[tuple[str, torch.dtype,
                  tuple[int, ...]]], produce: Callable[[str], torch.Tensor], shard_bytes: int, desc: str,
                  show_progress: bool, config: dict[str, Any], note: str) -> Path:
    """A checkpoint derived from `checkpoint` written to `out_dir` through a temporary sibling renamed when complete:
    its tensors (`entries`, each made by `produce`), its original's config.json updated with `config`, and its side
    files under `note` (`copy_side_files`). Returns `out_dir`."""
    with atomic_dir(out_dir, force) as tmp:
        write_shards(tmp, entries, produce, shard_bytes, desc, show_progress)
        (tmp / "config.json").write_text(json.dumps(dict(checkpoint.config) | config, indent=2))
        copy_side_files(checkpoint, tmp, note)
    checkpoint.files.close()
    return out_dir


@dataclass(frozen=True)
class SplitLayout:
    """A run's view of a split checkpoint: the model routes `experts` whole experts of width `intermediate`; the
    store and executors hold `parts` parts of each, numbered e·parts + j."""

    parts: int
    experts: int
    top_k: int
    intermediate: int

    def paging_config(self, cfg: ModelConfig) -> ModelConfig:
        """The configuration stores and executors size themselves by: parts as experts (E·S of F/S each, a token's
        top-k·S of them), the rest the model's."""
        return replace(cfg, num_experts=self.experts * self.parts, top_k=self.top_k * self.parts,
                       expert_intermediate_size=self.intermediate // self.parts)
