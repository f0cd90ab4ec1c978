"""HF `architectures` string -> our model code. One line per architecture; unknown names fail loudly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moepager.errors import CheckpointError, UnsupportedArchitectureError
from moepager.models import deepseek_v2, deepseek_v3, mixtral, olmoe, qwen2_moe, qwen3_moe
from moepager.models.base import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        mixtral.ARCHITECTURE,
        qwen2_moe.ARCHITECTURE,
        qwen3_moe.ARCHITECTURE,
        olmoe.ARCHITECTURE,
        deepseek_v2.ARCHITECTURE,
        deepseek_v3.ARCHITECTURE,
    )
}


def architecture_for(raw_config: Mapping[str, Any]) -> Architecture:
    names = raw_config.get("architectures")
    if not names or not isinstance(names, list):
        raise CheckpointError("config.json has no 'architectures' list; cannot tell which model this is")
    try:
        return ARCHITECTURES[names[0]]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture '{names[0]}'; supported: {', '.join(sorted(ARCHITECTURES))}") from None
