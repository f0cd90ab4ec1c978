"""HF `architectures` string -> our model code. One line per architecture (each with its spec in models/specs.py);
unknown names fail loudly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from moepager.models import deepseek_v2, deepseek_v3, mixtral, olmoe, qwen2_moe, qwen3_moe
from moepager.models.base import Architecture
from moepager.models.specs import spec_for

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
    """The architecture config.json names (models/specs.py `spec_for` says why it cannot be one)."""
    return ARCHITECTURES[spec_for(raw_config).name]


def tensor_specs(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(disk name, shape) of every tensor a checkpoint of this config holds, in Hub (per-expert) layout: the model's
    own modules built on the meta device, and the architecture's per-expert names (what make-model writes and a GGUF
    file's conversion fills in: checkpoints/gguf_read.py `TensorSpecs`)."""
    arch = architecture_for(config)
    cfg = arch.parse_config(config)
    with torch.device("meta"):
        model = arch.build(cfg, experts=None)  # type: ignore[arg-type]  # never called: no forward pass
    specs = [(model.disk_name(n), tuple(t.shape)) for n, t in model.state_dict().items()]
    f, d, naming = cfg.expert_intermediate_size, cfg.hidden_size, arch.expert_naming
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            specs += [(naming.gate.format(layer=layer, expert=e), (f, d)),
                      (naming.up.format(layer=layer, expert=e), (f, d)),
                      (naming.down.format(layer=layer, expert=e), (d, f))]
    return specs
