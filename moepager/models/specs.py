"""What a checkpoint's config.json says of each supported architecture: how its fields become a `ModelConfig` and
what its routed-expert tensors are named. A leaf below the model code (it imports only `models/config.py`,
`models/naming.py` and the errors), so the checkpoint formats (checkpoints/) read a checkpoint without importing a
module; `models/registry.py` joins each spec with its architecture's `build`.

Adding an architecture: its spec here (a parser and its naming, one line in `SPECS`), its model file, one line in
`models/registry.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from moepager.errors import CheckpointError, UnsupportedArchitectureError
from moepager.models.config import ModelConfig, eos_ids, get, rope_from_raw
from moepager.models.naming import MIXTRAL_EXPERTS, PER_EXPERT_MLP, ExpertNaming


@dataclass(frozen=True)
class ArchSpec:
    """One supported HF architecture as its checkpoint describes it: its `architectures` name, how to read its
    config, and how its expert tensors are named."""

    name: str
    parse_config: Callable[[Mapping[str, Any]], ModelConfig]
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


def parse_mixtral(raw: Mapping[str, Any]) -> ModelConfig:
    """Mixtral: every layer sparse; experts as wide as `intermediate_size`; an optional sliding window."""
    fields = common_fields(raw, default_eps=1e-5, default_max_pos=131072)
    head_dim = get(raw, "head_dim", fields["hidden_size"] // fields["num_heads"], kind=int)
    layers = fields["num_layers"]
    return ModelConfig(
        **fields,
        head_dim=head_dim,
        rope=rope_from_raw(raw, head_dim, default_theta=1e6),
        moe_layers=tuple(range(layers)),
        num_experts=get(raw, "num_local_experts", kind=int),
        top_k=get(raw, "num_experts_per_tok", kind=int),
        expert_intermediate_size=get(raw, "intermediate_size", kind=int),
        dense_intermediate_size=get(raw, "intermediate_size", kind=int),
        sliding_window=get(raw, "sliding_window", None),
    )


def sparse_layers(raw: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """Qwen's rule for which layers are MoE (shared by Qwen2-MoE and Qwen3-MoE)."""
    step = get(raw, "decoder_sparse_step", 1, kind=int)
    dense = set(get(raw, "mlp_only_layers", [], kind=list))
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def parse_qwen(raw: Mapping[str, Any], *, shared_expert: bool) -> ModelConfig:
    """Config of Qwen2-MoE (with its shared expert) or Qwen3-MoE (without)."""
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{raw['architectures'][0]} with use_sliding_window=true is not supported")
    fields = common_fields(raw, default_eps=1e-6, default_max_pos=32768)
    head_dim = get(raw, "head_dim", fields["hidden_size"] // fields["num_heads"], kind=int)
    return ModelConfig(
        **fields,
        head_dim=head_dim,
        rope=rope_from_raw(raw, head_dim),
        moe_layers=sparse_layers(raw, fields["num_layers"]),
        num_experts=get(raw, ("num_experts", "num_local_experts"), kind=int),
        top_k=get(raw, "num_experts_per_tok", kind=int),
        expert_intermediate_size=get(raw, "moe_intermediate_size", kind=int),
        dense_intermediate_size=get(raw, "intermediate_size", kind=int),
        shared_intermediate_size=get(raw, "shared_expert_intermediate_size", kind=int) if shared_expert else 0,
    )


def parse_qwen2_moe(raw: Mapping[str, Any]) -> ModelConfig:
    return parse_qwen(raw, shared_expert=True)


def parse_qwen3_moe(raw: Mapping[str, Any]) -> ModelConfig:
    return parse_qwen(raw, shared_expert=False)


def parse_olmoe(raw: Mapping[str, Any]) -> ModelConfig:
    """OLMoE: every layer sparse, head_dim from the hidden size."""
    fields = common_fields(raw, default_eps=1e-5, default_max_pos=4096)
    head_dim = fields["hidden_size"] // fields["num_heads"]
    return ModelConfig(
        **fields,
        head_dim=head_dim,
        rope=rope_from_raw(raw, head_dim),
        moe_layers=tuple(range(fields["num_layers"])),
        num_experts=get(raw, ("num_experts", "num_local_experts"), kind=int),
        top_k=get(raw, "num_experts_per_tok", kind=int),
        expert_intermediate_size=get(raw, "intermediate_size", kind=int),
        dense_intermediate_size=get(raw, "intermediate_size", kind=int),
    )


def parse_deepseek(raw: Mapping[str, Any], *, experts_key: str = "n_routed_experts") -> ModelConfig:
    """Config of either DeepSeek version (V3 differs only in router keys, read by its router)."""
    fields = common_fields(raw, default_eps=1e-6, default_max_pos=4096)
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        get(raw, key, kind=int)
    moe_i = get(raw, "moe_intermediate_size", kind=int)
    first_dense = get(raw, "first_k_dense_replace", 0, kind=int)
    freq = get(raw, "moe_layer_freq", 1, kind=int)
    return ModelConfig(
        **fields,
        head_dim=raw["qk_rope_head_dim"],
        rope=rope_from_raw(raw, raw["qk_rope_head_dim"]),
        moe_layers=tuple(i for i in range(fields["num_layers"]) if i >= first_dense and i % freq == 0),
        num_experts=get(raw, experts_key, kind=int),
        top_k=get(raw, "num_experts_per_tok", kind=int),
        expert_intermediate_size=moe_i,
        dense_intermediate_size=get(raw, "intermediate_size", kind=int),
        shared_intermediate_size=moe_i * get(raw, "n_shared_experts", 0, kind=int),
    )


def parse_deepseek_v3(raw: Mapping[str, Any]) -> ModelConfig:
    key = "n_routed_experts" if "n_routed_experts" in raw else "num_local_experts"
    return parse_deepseek(raw, experts_key=key)


SPECS: dict[str, ArchSpec] = {
    s.name: s
    for s in (
        ArchSpec("MixtralForCausalLM", parse_mixtral, MIXTRAL_EXPERTS),
        ArchSpec("Qwen2MoeForCausalLM", parse_qwen2_moe, PER_EXPERT_MLP),
        ArchSpec("Qwen3MoeForCausalLM", parse_qwen3_moe, PER_EXPERT_MLP),
        ArchSpec("OlmoeForCausalLM", parse_olmoe, PER_EXPERT_MLP),
        ArchSpec("DeepseekV2ForCausalLM", parse_deepseek, PER_EXPERT_MLP),
        ArchSpec("DeepseekV3ForCausalLM", parse_deepseek_v3, PER_EXPERT_MLP),
    )
}


def spec_for(raw_config: Mapping[str, Any]) -> ArchSpec:
    """The spec of the architecture config.json names (its first `architectures` entry); unknown names fail loudly."""
    names = raw_config.get("architectures")
    if not names or not isinstance(names, list):
        raise CheckpointError("config.json has no 'architectures' list; cannot tell which model this is")
    try:
        return SPECS[names[0]]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture '{names[0]}'; supported: {', '.join(sorted(SPECS))}") from None
