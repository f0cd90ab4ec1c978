"""Quantized experts: the formats' formulas, and every kernel against the dequantized weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moepager.errors import ConfigError
from moepager.experts.quant import (
    INT8_PACKED_MAX_TOKENS,
    VNNI,
    QuantExpertWeights,
    QuantFormat,
    check_shape,
    dequantize_projection,
    int8_mm,
    int8_packed_mm,
    int8_prepack,
    pack_int4_cpu,
    pack_nibbles,
    parse_expert_dtype,
    quantize_expert,
    quantize_int4,
    quantize_int8,
    quantize_projection,
    unpack_nibbles,
)
from moepager.experts.reference import expert_forward
from moepager.experts.weights import ExpertShape, ExpertWeights, expert_view
from tests.conftest import needs_fbgemm

D, F_ = 128, 64
FORMATS = [QuantFormat(8), *(QuantFormat(4, g, z, layout) for g in (32, 64) for z in (False, True)
                             for layout in ("cpu", "plain"))]


def _ids(fmt: QuantFormat) -> str:
    return "int8" if fmt.bits == 8 else f"int4-g{fmt.group}-{'zp' if fmt.zero_point else 'sym'}-{fmt.layout}"


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * F_, D, generator=g) * 0.05, torch.randn(D, F_, generator=g) * 0.05


def _quantized(fmt: QuantFormat, dtype: torch.dtype) -> QuantExpertWeights:
    shape = ExpertShape(D, F_, dtype, fmt)
    w = expert_view(torch.zeros(shape.numel, dtype=shape.buffer_dtype), shape)
    gate_up, down = _weights()
    quantize_expert(gate_up, down, w, dtype)
    return w


def test_int8_is_symmetric_per_output_channel():
    w = torch.randn(16, 64)
    q, scale = quantize_int8(w, torch.float32)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale.shape == (16,)
    torch.testing.assert_close(q.float() * scale[:, None], w, atol=float(scale.max()) / 2 + 1e-7, rtol=0)


def test_int8_scales_rounded_to_bf16_never_push_a_weight_out_of_range():
    w = torch.randn(64, 64)
    q, scale = quantize_int8(w, torch.bfloat16)
    assert scale.dtype == torch.bfloat16 and (scale.float() * 127 >= w.abs().amax(1)).all()
    assert ((q.float() * scale.float()[:, None] - w).abs() <= scale.float()[:, None] / 2 + 1e-6).all()


def test_symmetric_int4_is_ggml_q4_0():
    w = torch.randn(4, 64)
    q, scale, zero = quantize_int4(w, 32, False, torch.float32)
    assert (zero == 0).all() and q.max() <= 15
    m = w.reshape(4, 2, 32).gather(-1, w.reshape(4, 2, 32).abs().argmax(-1, keepdim=True))[..., 0]
    torch.testing.assert_close(scale, m / -8)  # ggml's quantize_row_q4_0: d = max / -8
    idx = w.reshape(4, 2, 32).abs().argmax(-1)
    assert (q.reshape(4, 2, 32).gather(-1, idx[..., None]) == 0).all()  # the extreme maps to q - 8 = -8


def test_int4_zero_points_span_each_groups_range():
    w = torch.randn(4, 64) + 3  # far from symmetric: zero points pay off
    sym = dequantize_projection(quantize_projection(w, QuantFormat(4, 32, False), torch.float32), QuantFormat(4, 32))
    zp_fmt = QuantFormat(4, 32, True)
    zp = dequantize_projection(quantize_projection(w, zp_fmt, torch.float32), zp_fmt)
    assert (zp - w).abs().max() < (sym - w).abs().max()
    assert (zp - w).abs().max() <= ((w.amax() - w.amin()) / 15 / 2 + 1e-5)


def test_nibbles_round_trip_low_nibble_first():
    q = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    p = pack_nibbles(q)
    assert p.shape == (3, 4) and p[0, 0] == q[0, 0] | (q[0, 1] << 4)
    assert torch.equal(unpack_nibbles(p), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize("tokens", [1, 5, INT8_PACKED_MAX_TOKENS + 7])
def test_kernels_compute_with_the_dequantized_weights(fmt, dtype, tokens):
    w = _quantized(fmt, dtype)
    gate_up, down = w.dequantized()
    gate_up_ref, down_ref = _weights()
    proj_gu = quantize_projection(gate_up_ref, fmt, dtype)
    torch.testing.assert_close(gate_up.to(dtype), dequantize_projection(proj_gu, fmt).to(dtype))  # what was stored
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(w.gate_up(x).float(), F.linear(x.float(), gate_up), **tol)
    h = torch.randn(tokens, F_, generator=torch.Generator().manual_seed(2)).to(dtype)
    torch.testing.assert_close(w.down(h).float(), F.linear(h.float(), down), **tol)


@pytest.mark.parametrize("fmt", FORMATS[:3], ids=_ids)
def test_a_quantized_expert_stays_close_to_the_float_one(fmt):
    shape = ExpertShape(D, F_, torch.float32)
    ref = ExpertWeights.empty(shape)
    ref.gate_up_2FD.copy_(_weights()[0])
    ref.down_DF.copy_(_weights()[1])
    x = torch.randn(8, D)
    want = expert_forward(x, ref, F.silu)
    got = expert_forward(x, _quantized(fmt, torch.float32), F.silu)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < (0.02 if fmt.bits == 8 else 0.2), rel


def test_quantized_buffers_are_smaller():
    bf16 = ExpertShape(2048, 768, torch.bfloat16)
    int8 = ExpertShape(2048, 768, torch.bfloat16, QuantFormat(8))
    int4 = ExpertShape(2048, 768, torch.bfloat16, QuantFormat(4, 32))
    assert 0.5 <= int8.nbytes / bf16.nbytes < 0.51
    assert 0.25 < int4.nbytes / bf16.nbytes < 0.32  # a bf16 scale and zero per 32 weights
    assert int4.buffer_dtype == torch.uint8 and int4.float_shape == bf16


def test_bad_formats_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="unknown --expert-dtype 'int3'"):
        parse_expert_dtype("int3")
    with pytest.raises(ConfigError, match="one of 32, 64, 128"):
        parse_expert_dtype("int4", group=48)
    with pytest.raises(ConfigError, match="group size 128 does not divide the expert intermediate size 96; "
                                          "choose a group from 32"):
        check_shape(256, 96, QuantFormat(4, 128))
    with pytest.raises(ConfigError, match="multiples of 16"):
        check_shape(256, 36, QuantFormat(4, 4))  # (a group size the CLI never offers, to reach the check)
    check_shape(256, 96, QuantFormat(4, 32))
    check_shape(100, 30, QuantFormat(8))


@pytest.mark.parametrize("n,k", [(128, 64), (192, 96), (48, 64), (2816 // 4, 256)])
def test_the_cpu_int4_layout_is_torchs(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    assert torch.equal(pack_int4_cpu(pack_nibbles(q)), want)


@needs_fbgemm
def test_the_packed_int8_kernel_quantizes_each_row_of_its_input_on_its_own():
    """FBGEMM gives a call's input one scale; int8_packed_mm rescales rows first, so a tiny row next to a large
    one keeps 8 bits of resolution (a prefill's quiet tokens), and a single row is FBGEMM's own call."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=gen)
    q, scale = quantize_int8(w, torch.float32)
    packed = int8_prepack(q, scale)
    ref_w = q.double() * scale.double()[:, None]
    x = torch.randn(3, 256, generator=gen, dtype=torch.float64) * torch.tensor([[1e3], [1.0], [1e-3]],
                                                                                dtype=torch.float64)
    y = int8_packed_mm(x.float(), packed).double()
    for row in range(3):
        ref = x[row] @ ref_w.t()
        assert float((y[row] - ref).norm() / ref.norm()) < 0.02  # 8-bit activations: ~0.5% here
    one = int8_packed_mm(x[1:2].float(), packed)
    assert torch.equal(one, torch.ops.quantized.linear_dynamic(x[1:2].float(), packed, not VNNI))


@needs_fbgemm
def test_the_packed_int8_kernel_does_not_saturate():
    """Largest weights times large positive activations: u8 x s8 pairs summed in int16 would saturate (what
    FBGEMM's `reduce_range` guards against on CPUs without VNNI); the int32 sums here must not. A saturated sum would
    be off by ~49% (pairs capped at 32,767 of 64,770); what is left is the activations' quantization, 8-bit with VNNI
    and 7-bit (reduce_range, twice the error) without: 1.7e-4 relative on the Zen 3 (2026-12-02)."""
    q = torch.full((32, 512), 127, dtype=torch.int8)
    scale = torch.full((32,), 0.01)
    x = torch.rand(1, 512, generator=torch.Generator().manual_seed(1)) + 1.0
    y = int8_packed_mm(x, int8_prepack(q, scale))
    torch.testing.assert_close(y, x @ (q.float() * 0.01).t(), rtol=1e-4 if VNNI else 4e-4, atol=0)


@pytest.mark.parametrize("k", [8, 24, 40, 100])
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_int8_projections_of_any_length_compute_the_dequantized_product_in_bf16(k, tokens):
    """torch 2.13's int8 GEMV kernel is wrong (NaN, garbage, or a crash of the process) on bf16 inputs whose length
    is not a multiple of 16; int8_mm must not hand it those."""
    gen = torch.Generator().manual_seed(k + tokens)
    q, scale = quantize_int8(torch.randn(32, k, generator=gen), torch.bfloat16)
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
    ref = x.float() @ (q.float() * scale.float()[:, None]).t()
    torch.testing.assert_close(int8_mm(x, q, scale).float(), ref, atol=5e-2, rtol=2e-2)
