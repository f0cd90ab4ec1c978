"""`--dense-dtype int8`: the dense projections as int8 (lossy, opt-in), routers, norms, embeddings and MLA's
kv_b_proj untouched, and paging experts under it still lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moepager.accel import cpu_kernels
from moepager.accel.dense_quant import Int8A8Linear, Int8Linear, check_dense_dtype
from moepager.checkpoints.default import default_model_path
from moepager.config import EngineConfig, StoreConfig
from moepager.errors import ConfigError
from moepager.experts.quant import INT8_PACKED_MAX_TOKENS, int8_packing_available
from moepager.loading.synth import make_model
from moepager.runtime.builder import load_model
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from tests.runtime.test_offload import logits_run


@pytest.mark.parametrize("tokens", [1, INT8_PACKED_MAX_TOKENS + 1])  # the packed kernel, then dequantise + GEMM
def test_int8_linear_computes_with_its_dequantized_weights(tokens):
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 64, generator=gen).bfloat16(), torch.randn(48, generator=gen).bfloat16()
    x = torch.randn(2, tokens, 64, generator=gen).bfloat16()
    lin = Int8Linear(w, b)
    assert lin.q.dtype == torch.int8 and lin.scale.shape == (48,) and lin.q.nbytes == w.nbytes // 2
    w_q = lin.q.float() * lin.scale.float()[:, None]
    assert (w_q - w.float()).abs().max() <= w.float().abs().amax(1).max() / 254 * 1.01  # half a step per row
    got = lin(x)
    want = F.linear(x.float(), w_q, b.float())
    assert got.shape == (2, tokens, 48) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.05)


def linears(model: nn.Module) -> dict[str, type]:
    return {name: type(m) for name, m in model.named_modules() if isinstance(m, (nn.Linear, Int8Linear))}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "deepseek_v2", "mixtral"])
def test_dense_int8_quantizes_every_dense_projection_and_only_those(tmp_path, arch):
    path = make_model(tmp_path / arch, "tiny", arch, dtype="bfloat16", show_progress=False)
    ref = load_model(path, torch.float32, show_progress=False)  # bf16 weights computed in fp32, as logits_run wants
    got = load_model(path, torch.float32, show_progress=False, dense_dtype="int8")
    kinds = linears(got.model)
    kept = {n for n, k in kinds.items() if k is nn.Linear}
    assert {n.rsplit(".", 1)[-1] for n in kept} == {"deepseek_v2": {"kv_b_proj"}, "qwen2_moe": {"shared_expert_gate"}
                                                    }.get(arch, set())
    assert kinds["lm_head"] is Int8Linear and got.dense_format == "int8" and ref.dense_format == "float32"
    if arch != "deepseek_v2":
        assert "model.layers.0.self_attn.qkv" in kinds and "model.layers.0.self_attn.q_proj" not in kinds
    assert got.model.model.embed_tokens.weight.dtype == torch.float32
    for a, b in zip(logits_run(got), logits_run(ref)):
        assert not torch.equal(a, b)  # it did change the computation ...
        assert (a.float() - b.float()).norm() < 0.1 * b.float().norm()  # ... by int8's rounding


def test_a_tied_head_gets_its_own_int8_copy_and_the_run_says_so():
    llm = LLM(config=EngineConfig(dense_dtype="int8"), show_progress=False)
    model = llm.loaded.model
    assert isinstance(model.lm_head, Int8Linear) and model.config.tie_word_embeddings
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    out = llm.generate(["The history of"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8
    assert llm.last_stats.dense == "int8" and "int8 (lossy)" in llm.last_stats.table()


def test_paging_experts_under_dense_int8_is_still_lossless():
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    resident = LLM(config=EngineConfig(dense_dtype="int8"), show_progress=False)
    paged = LLM(config=EngineConfig(dense_dtype="int8", store=StoreConfig(expert_memory="25%", direct_io="off")),
                show_progress=False)
    prompts = ["The history of", "Once upon a time"]
    assert [o.token_ids for o in paged.generate(prompts, params)] == \
        [o.token_ids for o in resident.generate(prompts, params)]


def test_an_unknown_dense_dtype_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="unknown --dense-dtype 'int4'; choose from int8"):
        EngineConfig(dense_dtype="int4")
    with pytest.raises(ConfigError, match="unknown --dense-dtype 'fp8'"):
        load_model(default_model_path(), show_progress=False, dense_dtype="fp8")


@pytest.fixture(params=["moepager", "fbgemm"])
def a8_kernel(request, monkeypatch):
    """int8-a8 on moepager's int8 GEMV (where it is built here) and on FBGEMM (moepager's kernels turned off)."""
    if request.param == "moepager" and not cpu_kernels.available():
        pytest.skip(f"no moepager CPU kernels here: {cpu_kernels.unsupported_reason()}")
    if request.param == "fbgemm":
        if not int8_packing_available():
            pytest.skip("this torch build has no FBGEMM engine")
        monkeypatch.setattr(cpu_kernels, "_state", cpu_kernels.Selected("torch", None, "this test runs FBGEMM"))
    return request.param


@pytest.mark.parametrize("tokens", [1, 5, 12])
def test_int8_a8_linear_computes_the_int8_projection_with_quantized_activations(tokens, a8_kernel):
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 64, generator=gen).bfloat16(), torch.randn(48, generator=gen).bfloat16()
    x = torch.randn(2, tokens, 64, generator=gen).bfloat16()
    a8 = Int8A8Linear(w, b)
    assert (a8._ours is not None) == (a8_kernel == "moepager")
    got, ref = a8(x), Int8Linear(w, b)
    want = F.linear(x.float(), ref.q.float() * ref.scale.float()[:, None], b.float())
    assert got.shape == (2, tokens, 48) and got.dtype == torch.bfloat16
    err = (got.float() - want).norm(dim=-1) / want.norm(dim=-1)  # per token: 8-bit activations, then bf16
    assert float(err.max()) < 0.02


def test_dense_int8_a8_runs_every_dense_projection_quantized_and_says_so(a8_kernel):
    llm = LLM(config=EngineConfig(dense_dtype="int8-a8"), show_progress=False)
    kinds = {type(m) for m in llm.loaded.model.modules() if isinstance(m, (nn.Linear, Int8Linear, Int8A8Linear))}
    assert Int8A8Linear in kinds and Int8Linear not in kinds
    ref = LLM(config=EngineConfig(dense_dtype="int8"), show_progress=False)
    want = ref.generate(["The history of"], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    out = llm.generate(["The history of"], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert sum(a == b for a, b in zip(out, want)) >= 6  # lossier than int8, not another model
    assert "activations quantized to 8 bits) (lossy)" in llm.last_stats.table()


def test_dense_int8_a8_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="FBGEMM on the CPU"):
        check_dense_dtype("int8-a8", "cuda")
