"""Model geometries for `make-model`: real models' shapes (from their published config.json) and `tiny`
test shapes per architecture. Values are written as transformers 5 config keys."""

from __future__ import annotations

from typing import Any

from moepager.errors import MoepagerError

_TINY_COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, tie_word_embeddings=False)
_TINY_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                 intermediate_size=96, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                 num_hidden_layers=3)

ARCH_TYPES = {
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "deepseek_v2"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek_v3"),
}

TINY: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      num_experts=8, num_experts_per_tok=2, qkv_bias=True, norm_topk_prob=False),
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_key_value_heads=4),
    "deepseek_v2": dict(_TINY_MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
                        topk_method="greedy", routed_scaling_factor=1.0),
    "deepseek_v3": dict(_TINY_MLA, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True),
}

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-8x7b": ("mixtral", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_parameters={"rope_theta": 1e6, "rope_type": "default"})),
    "qwen1.5-moe-a2.7b": ("qwen2_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, qkv_bias=True, max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope_parameters={"rope_theta": 1e6, "rope_type": "default"})),
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"})),
    "olmoe-1b-7b": ("olmoe", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_parameters={"rope_theta": 1e4, "rope_type": "default"})),
    "deepseek-v2-lite": ("deepseek_v2", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, topk_method="greedy", routed_scaling_factor=1.0,
        max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1e4, "rope_type": "yarn", "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 0.707, "mscale_all_dim": 0.707})),
    "demo": ("qwen3_moe", dict(
        vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1e4, "rope_type": "default"})),
}
PRESET_NAMES = sorted([*PRESETS, "tiny"])


def preset_config(preset: str, arch: str | None, layers: int | None) -> dict[str, Any]:
    """config.json contents for `preset` (with `arch` for `tiny`), optionally with fewer layers."""
    if arch is not None and arch not in ARCH_TYPES:
        raise MoepagerError(f"unknown architecture '{arch}'; choose from {', '.join(ARCH_TYPES)}")
    if preset == "tiny":
        if arch is None:
            raise MoepagerError(f"--preset tiny needs --arch (one of {', '.join(ARCH_TYPES)})")
        values = {**_TINY_COMMON, **TINY[arch]}
    elif preset in PRESETS:
        preset_arch, values = PRESETS[preset]
        if arch is not None and arch != preset_arch:
            raise MoepagerError(f"preset '{preset}' is a {preset_arch} model, not {arch}")
        arch = preset_arch
        values = dict(values)
    else:
        raise MoepagerError(f"unknown preset '{preset}'; choose from {', '.join(PRESET_NAMES)}")
    if layers is not None:
        if layers < 1:
            raise MoepagerError(f"--layers must be >= 1, got {layers}")
        values["num_hidden_layers"] = layers
    architecture, model_type = ARCH_TYPES[arch]
    return {"architectures": [architecture], "model_type": model_type, "hidden_act": "silu", "bos_token_id": None,
            **values}
