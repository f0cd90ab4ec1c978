"""The built-in default model: until a trained demo model ships, a small random-weight Qwen3-MoE
(`make-model --preset demo`: 4 layers, 32 experts, top-4, 2k vocab, ~28 MB bf16) created in the cache
directory on first use. Its text is noise; its routing and memory behaviour are real."""

from __future__ import annotations

import shutil
from pathlib import Path

from moepager.models.synth import make_model

DEFAULT_MODEL_NAME = "demo-random-v1"


def default_model_path(cache_dir: Path, show_progress: bool = True) -> Path:
    path = cache_dir / DEFAULT_MODEL_NAME
    if (path / "config.json").exists():
        return path
    tmp = cache_dir / f".{DEFAULT_MODEL_NAME}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    make_model(tmp, "demo", show_progress=show_progress)
    tmp.rename(path)
    return path
