"""What every architecture file provides, and the config fields all of them parse the same way."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from moepager.errors import CheckpointError
from moepager.experts.executor import ExpertExecutor
from moepager.models.backend import Backend
from moepager.models.config import ModelConfig, eos_ids, get
from moepager.models.layers import CausalLM


@dataclass(frozen=True)
class ExpertNaming:
    """An architecture's tensor names for routed experts; `{layer}` and `{expert}` are filled in."""

    gate: str
    up: str
    down: str
    fused_gate_up: str
    fused_down: str


PER_EXPERT_MLP = ExpertNaming(
    gate="model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
    up="model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
    down="model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
    fused_gate_up="model.layers.{layer}.mlp.experts.gate_up_proj",
    fused_down="model.layers.{layer}.mlp.experts.down_proj",
)
"""Names used by Qwen2/3-MoE, OLMoE and DeepSeek (Mixtral has its own)."""


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


def common_fields(raw: Mapping[str, Any], *, default_eps: float, default_max_pos: int) -> dict[str, Any]:
    """Fields every architecture reads identically from config.json."""
    hidden = get(raw, "hidden_size", kind=int)
    heads = get(raw, "num_attention_heads", kind=int)
    for key in ("vocab_size", "num_hidden_layers"):
        get(raw, key, kind=int)
    if hidden <= 0 or heads <= 0:
        raise CheckpointError(f"config.json has non-positive hidden_size ({hidden}) or num_attention_heads ({heads})")
    if get(raw, "hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act '{raw['hidden_act']}' is not supported (only silu experts)")
    return dict(
        architecture=raw["architectures"][0],
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=get(raw, "num_key_value_heads", heads, kind=int),
        rms_norm_eps=float(get(raw, "rms_norm_eps", default_eps)),
        max_position_embeddings=get(raw, "max_position_embeddings", default_max_pos, kind=int),
        tie_word_embeddings=bool(get(raw, "tie_word_embeddings", False)),
        eos_token_ids=eos_ids(raw),
        bos_token_id=raw.get("bos_token_id"),
        raw=dict(raw),
    )
