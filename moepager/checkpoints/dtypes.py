"""Dtype names on the command line and in checkpoints, and the dtype a checkpoint stores (what a run computes in
unless told otherwise)."""

from __future__ import annotations

import torch

from moepager.checkpoints.safetensors import Checkpoint
from moepager.errors import CheckpointError

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype '{name}'; choose from {', '.join(DTYPES)}") from None


def checkpoint_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The dtype the checkpoint stores its embeddings in (what a run uses unless told otherwise)."""
    loc = checkpoint.locations.get("model.embed_tokens.weight")
    return loc.dtype if loc is not None else parse_dtype(str(checkpoint.config.get("torch_dtype", "float32")))
