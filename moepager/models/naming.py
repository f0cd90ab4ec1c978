"""Each architecture's tensor names for its routed experts: what a checkpoint reader needs to find them (a leaf:
checkpoints/ reads it without importing model code)."""

from __future__ import annotations

from dataclasses import dataclass, replace


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

MIXTRAL_EXPERTS = replace(
    PER_EXPERT_MLP,
    gate="model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
    up="model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
    down="model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
)
"""Mixtral's Hub names (`block_sparse_moe`, experts w1 gate, w3 up, w2 down); transformers' fused layout names the
block `mlp`, as the others."""
