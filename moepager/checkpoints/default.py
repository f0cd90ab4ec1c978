"""The built-in default model: `demo-moe`, a small Qwen3-MoE (6 layers, 32 experts, top-4, 8k BPE vocabulary,
~25 MB in bf16) trained by `scripts/train_demo_model.py` and shipped as package data. Its model card
(README.md beside the weights) records the training command, losses and sample continuations."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from moepager.errors import CheckpointError

DEFAULT_MODEL_NAME = "demo-moe"


def default_model_path() -> Path:
    """The packaged checkpoint directory (a real directory: the package is installed as files)."""
    path = Path(str(resources.files("moepager").joinpath("data", DEFAULT_MODEL_NAME)))
    if not (path / "config.json").exists():
        raise CheckpointError(f"the built-in model is missing from {path}; reinstall moepager or pass --model DIR "
                              "(scripts/train_demo_model.py rebuilds it)")
    return path
