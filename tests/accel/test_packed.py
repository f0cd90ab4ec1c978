"""Dense bf16 projections prepacked for oneDNN: which are packed, that they compute the same projections, and that
offloading stays lossless on top of them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moepager.accel import packed
from moepager.accel.packed import PackedLinear, packing_available
from moepager.config import StoreConfig
from moepager.errors import ConfigError
from moepager.experts.executor import PackedExecutor
from moepager.experts.quant import QuantFormat
from moepager.experts.weights import ExpertShape
from moepager.loading.build import resident_executor
from moepager.models.attention import Attention
from moepager.models.moe import SoftmaxTopKRouter
from moepager.placements.paged import paged_executor
from moepager.runtime.builder import load_model
from tests.conftest import ARCHS, expert_budget
from tests.runtime.test_offload import logits_run

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")
BF16 = torch.bfloat16
CPU = torch.device("cpu")


pytestmark = [pytestmark, pytest.mark.usefixtures("onednn")]  # oneDNN's kernel, not moepager's (conftest.py)


@pytest.fixture
def pack_all(monkeypatch):
    """Pack every dense projection, however small (the tiny test models are far below the real threshold)."""
    monkeypatch.setattr(packed, "PACK_MIN_ELEMENTS", 0)


@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (3, 5, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_projection_computes_the_linear_map(shape, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(BF16)
    b = torch.randn(96, generator=g).to(BF16) if bias else None
    x = torch.randn(*shape, generator=g).to(BF16)
    y = PackedLinear(w, b)(x)
    assert y.shape == (*shape[:-1], 96) and y.dtype == BF16
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)  # bf16: the last bit may differ


def test_loading_packs_the_large_bf16_projections_only(hf_checkpoint, monkeypatch):
    _, path = hf_checkpoint("qwen3_moe")
    tiny = load_model(path, dtype=BF16, show_progress=False)
    assert not any(isinstance(m, PackedLinear) for m in tiny.model.modules())  # all below PACK_MIN_ELEMENTS
    monkeypatch.setattr(packed, "PACK_MIN_ELEMENTS", 0)
    assert not any(isinstance(m, PackedLinear) for m in load_model(path, show_progress=False).model.modules())  # fp32
    model = load_model(path, dtype=BF16, show_progress=False).model
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    assert all(isinstance(a.qkv, PackedLinear) and a.q_proj is None for a in attn)
    assert all(isinstance(a.o_proj, PackedLinear) for a in attn)
    assert isinstance(model.lm_head, PackedLinear)
    assert all(isinstance(m.weight, torch.nn.Parameter) for m in model.modules() if isinstance(m, SoftmaxTopKRouter))
    unpacked = load_model(path, dtype=BF16, show_progress=False, pack_dense=False).model
    assert not any(isinstance(m, PackedLinear) for m in unpacked.modules())


@pytest.mark.parametrize("tied", [False, True])
def test_pack_lm_head_packs_the_head_alone(hf_checkpoint, tied, monkeypatch):
    _, path = hf_checkpoint("qwen3_moe")
    model = load_model(path, dtype=BF16, show_progress=False, pack_dense=False).model
    if tied:
        model.lm_head = None  # the logits from the embedding's matrix, as a tied checkpoint computes them
    x = torch.ones(1, model.config.hidden_size, dtype=BF16)
    want = F.linear(x, model.model.embed_tokens.weight) if tied else model.lm_head(x)
    assert not packed.pack_lm_head(model) and not isinstance(model.lm_head, PackedLinear)  # below the threshold
    monkeypatch.setattr(packed, "PACK_MIN_ELEMENTS", 0)
    assert not packed.pack_lm_head(load_model(path, show_progress=False, pack_dense=False).model)  # fp32 stays
    assert packed.pack_lm_head(model) and isinstance(model.lm_head, PackedLinear)
    assert not any(isinstance(m, PackedLinear) for m in model.model.modules())  # the projections keep their weights
    got = model.lm_head(x)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    assert not packed.pack_lm_head(model)  # once


@pytest.mark.parametrize("arch", ARCHS)
def test_a_packed_model_computes_the_unpacked_models_logits(hf_checkpoint, arch, pack_all):
    _, path = hf_checkpoint(arch)
    got = logits_run(load_model(path, dtype=BF16, show_progress=False))
    ref = logits_run(load_model(path, dtype=BF16, show_progress=False, pack_dense=False))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


def test_offloading_stays_bit_exact_over_packed_projections(hf_checkpoint, pack_all, tmp_path):
    hf, _ = hf_checkpoint("olmoe")
    path = tmp_path / "bf16"
    copy.deepcopy(hf).to(BF16).save_pretrained(path)  # a bf16 checkpoint: the store reads experts as they lie
    resident = load_model(path, show_progress=False)
    assert isinstance(resident.model.lm_head, PackedLinear)
    ref = logits_run(resident, steps=6)
    config = StoreConfig(expert_memory=expert_budget(resident.expert_shape.nbytes, 3), warm=False)
    paged = load_model(path, executor_factory=paged_executor(config, CPU),
                       show_progress=False)
    assert all(torch.equal(a, b) for a, b in zip(logits_run(paged, steps=6), ref))
    assert sum(p.loads_on_demand for p in paged.experts.store.counters.phases.values()) > 0
    paged.experts.store.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_packed_expert_kernel_computes_the_loop_kernels_logits(hf_checkpoint, arch):
    _, path = hf_checkpoint(arch)
    got = load_model(path, dtype=BF16, executor_factory=resident_executor(CPU, "packed"), show_progress=False)
    assert isinstance(got.experts, PackedExecutor)
    ref = load_model(path, dtype=BF16, executor_factory=resident_executor(CPU, "loop"), show_progress=False)
    for a, b in zip(logits_run(got, rows=2), logits_run(ref, rows=2)):  # prefill of two rows, then decodes
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_packed_int8_kernel_computes_the_int8_loop_kernels_logits(hf_checkpoint, arch):
    """FBGEMM on prepacked int8 weights with 8-bit activations: close to the weight-only int8 kernel's logits
    (the activations' quantization is the difference), and the run says its kernel is lossier than int8."""
    _, path = hf_checkpoint(arch)
    got = load_model(path, dtype=BF16, expert_dtype="int8", executor_factory=resident_executor(CPU, "packed"),
                     show_progress=False)
    assert isinstance(got.experts, PackedExecutor) and got.expert_format == "int8 (packed kernel: activations " \
        "quantized to 8 bits)"
    ref = load_model(path, dtype=BF16, expert_dtype="int8", executor_factory=resident_executor(CPU, "loop"),
                     show_progress=False)
    assert ref.expert_format == "int8"
    for a, b in zip(logits_run(got, rows=2), logits_run(ref, rows=2)):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


def test_the_packed_expert_kernel_refuses_what_it_cannot_compute(hf_checkpoint):
    _, path = hf_checkpoint("olmoe")
    with pytest.raises(ConfigError, match="computes bf16 .oneDNN. or int8 .FBGEMM. experts on the CPU"):
        load_model(path, executor_factory=resident_executor(CPU, "packed"), show_progress=False)  # fp32
    int4 = ExpertShape(64, 64, BF16, QuantFormat(4, 32))
    with pytest.raises(ConfigError, match="int8 .FBGEMM. experts on the CPU; these are int4"):
        PackedExecutor([], int4, [], 0, CPU)
    with pytest.raises(ConfigError, match="resident experts only"):
        load_model(path, dtype=BF16, executor_factory=paged_executor(StoreConfig(expert_memory="64MiB"), CPU, "packed"),
                   show_progress=False)
