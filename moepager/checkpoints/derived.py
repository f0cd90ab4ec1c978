"""What every checkpoint moepager derives from another shares: the original's side files copied beside the new tensors,
and the marker of a split checkpoint (checkpoints/split.py), which the other writers refuse to take as an original."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from moepager.checkpoints.safetensors import Checkpoint
from moepager.errors import CheckpointError

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
