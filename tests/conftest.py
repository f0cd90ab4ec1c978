"""Tiny random checkpoints written by transformers' save_pretrained (the numerical reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
MLA = dict(intermediate_size=40, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=8,
           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, first_k_dense_replace=1)

TINY_CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=24, num_key_value_heads=2,
                                                  num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16,
                                                     shared_expert_intermediate_size=24, num_key_value_heads=2,
                                                     num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1]),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=8, intermediate_size=40,
                                                     moe_intermediate_size=16, num_key_value_heads=2, num_experts=6,
                                                     num_experts_per_tok=2, norm_topk_prob=True),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, intermediate_size=16, num_key_value_heads=4, num_experts=8,
                                              num_experts_per_tok=2, clip_qkv=0.5),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(**COMMON, **MLA, num_experts_per_tok=3, n_shared_experts=2,
                                                         q_lora_rank=None, topk_method="group_limited_greedy",
                                                         n_group=4, topk_group=2, routed_scaling_factor=1.5),
    "deepseek_v2_yarn": lambda: transformers.DeepseekV2Config(
        **COMMON, **MLA, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=None,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 0.707, "mscale_all_dim": 0.707}),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**COMMON, **MLA, num_experts_per_tok=2, n_shared_experts=1,
                                                         q_lora_rank=12, n_group=4, topk_group=2),
}
ARCHS = sorted(TINY_CONFIGS)


def _our_tiers() -> list[str]:
    from moepager.accel import cpu_tiers

    return [] if cpu_tiers.platform_reason() else [t for t in cpu_tiers.runnable() if t != cpu_tiers.TORCH]


OUR_TIERS = _our_tiers()
"""moepager's CPU tiers this CPU runs, best first (accel/cpu_tiers.py): the native tier, then every lower one it can
force (on an AVX-512 host: avx512-bf16, avx2, portable)."""


@pytest.fixture(params=OUR_TIERS)
def tier(request, monkeypatch) -> str:
    """The test runs once on each of OUR_TIERS: this process's CPU kernels are that tier's module (built here if need
    be). A tier this CPU runs that cannot be built or fails its self-test fails the test; it is never skipped."""
    from moepager.accel import cpu_kernels

    module = cpu_kernels.module_for(request.param)
    monkeypatch.setattr(cpu_kernels, "_state", cpu_kernels.Selected(request.param, module))
    return request.param


def _has_fbgemm() -> bool:
    from moepager.experts.quant import int8_packing_available

    return int8_packing_available()


needs_fbgemm = pytest.mark.skipif(not _has_fbgemm(), reason="this torch build has no FBGEMM engine")
"""For tests of the int8 kernels on FBGEMM (`--expert-kernel packed` on int8, `--dense-dtype int8-a8`)."""


def make_hf_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random HF model with non-trivial norms, biases and router biases."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS[arch]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if "correction_bias" in name:
                b.normal_(0, 0.1)
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: (arch, fused) -> (HF model, checkpoint directory), cached for the session."""
    made: dict[tuple[str, bool], tuple[torch.nn.Module, Path]] = {}

    def get(arch: str, fused: bool = False) -> tuple[torch.nn.Module, Path]:
        if (arch, fused) not in made:
            model = made[(arch, not fused)][0] if (arch, not fused) in made else make_hf_model(arch)
            path = tmp_path_factory.mktemp(f"{arch}_{'fused' if fused else 'hub'}")
            model.save_pretrained(path, save_original_format=not fused)
            made[(arch, fused)] = (model, path)
        return made[(arch, fused)]

    return get


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory) -> Path:
    """A make-model checkpoint with a tokenizer (Qwen3-MoE tiny geometry)."""
    from moepager.loading.synth import make_model

    return make_model(tmp_path_factory.mktemp("tiny_qwen3"), "tiny", "qwen3_moe", dtype="float32",
                      show_progress=False)


@pytest.fixture
def onednn(monkeypatch):
    """Dense projections on oneDNN's prepacked kernel, as on a machine without moepager's own CPU kernels (which take
    precedence where they run: tests/accel/test_cpu_kernels.py). Skipped where oneDNN's bf16 kernel cannot run (a CPU
    without AVX-512: experts/onednn.py probes it)."""
    from moepager.accel import cpu_kernels
    from moepager.experts.onednn import unavailable_reason

    if (reason := unavailable_reason()) is not None:
        pytest.skip(f"oneDNN's prepacked bf16 kernel does not run here: {reason}")
    monkeypatch.setattr(cpu_kernels, "_state", cpu_kernels.Selected("torch", None, "this test runs oneDNN's"))


def expert_budget(nbytes: int, experts: int, io_threads: int = 4) -> str:
    """An --expert-memory byte budget caching exactly `experts` experts of `nbytes` beside the store's stream
    rows and O_DIRECT read buffers (which every budget below all includes: one bounce buffer per I/O thread and
    for the prefetch lane)."""
    from moepager.checkpoints.disk import bounce_bytes
    from moepager.placements.stores import STREAM_ROWS

    return str((experts + STREAM_ROWS) * nbytes + (io_threads + 1) * bounce_bytes(nbytes))
