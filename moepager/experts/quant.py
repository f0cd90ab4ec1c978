"""Weight-only quantized experts: int8 (symmetric, one scale per output channel) and int4 (groups along the
input dimension, one scale and one zero per group). Lossy, so opt-in (`--expert-dtype int8|int4`).

Formulas (what `moepager quantize` writes and every kernel computes with; q is the stored integer):
- int8: w = q * scale[row], q in [-127, 127], scale = absmax(row) / 127.
- int4: w = (q - 8) * scale[row, group] + zero[row, group], q in [0, 15]. Symmetric (the default, exactly
  llama.cpp's Q4_0 when the group is 32): scale = m / -8 where m is the group's value of largest magnitude,
  zero = 0 (ggml's `quantize_row_q4_0`). With zero points: scale = (max - min) / 15, zero = min + 8 * scale
  (tinygemm's convention, which torch's int4 kernels use).
Scales are rounded to the run's dtype before the integers are chosen, so the stored integers are exact for
the scales the kernels multiply by.

An expert's flat buffer (experts/weights.py) is then bytes: [q gate_up | q down | gate_up scales | down
scales], each section 64-byte aligned. int4 weights sit in the buffer in the layout of the kernel that reads
them: on the CPU torch's `_convert_weight_to_int4pack_for_cpu` layout (a blocked permutation made when an expert
is read, `pack_int4_cpu`), elsewhere the plain nibble layout of the checkpoint (low nibble = even input index).

Kernels (one projection; measured by `python benchmarks/expert_kernels.py --formats`):
- int8: `aten._weight_int8pack_mm` (a GEMV kernel: its time grows linearly with tokens) for up to
  INT8_PACKED_MAX_TOKENS tokens; above, dequantising to the run's dtype and one GEMM is faster. Past one token both
  are slower than bf16: weight-only quantization pays at decode, where bytes decide, and costs in prefill.
- int4 on the CPU: `aten._weight_int4pack_mm_for_cpu` at every size (no faster dequantiser exists for its
  layout).
- CUDA (not yet run on a GPU): both dequantise to the run's dtype and call one GEMM: the store still holds,
  reads and copies the quantized bytes, so a budget holds 2x (int8) or ~4x (int4) the experts.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from moepager.config import EXPERT_DTYPES, INT4_GROUPS
from moepager.errors import ConfigError

INT8_PACKED_MAX_TOKENS = 32
"""int8 calls on more tokens than this dequantise and run one GEMM (see the module note)."""
ALIGN = 64


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class QuantFormat:
    """How an expert's weights are quantized and laid out in memory."""

    bits: Literal[8, 4]
    group: int = 0
    """int4: input elements per scale (32, 64 or 128); 0 for int8 (one scale per output channel)."""
    zero_point: bool = False
    """int4: asymmetric groups with a zero each (otherwise symmetric, zero = 0)."""
    layout: Literal["cpu", "plain", "rows"] = "cpu"
    """int4 weights in the buffer: torch's CPU int4pack layout; plain nibbles with [K/g, N, 2] scales and zeros (CUDA,
    checkpoints); or plain nibbles with row-major [N, K/g] scales, symmetric only (the fused CPU kernel's,
    accel/cpu_kernels.py: a row's scales are contiguous)."""

    @property
    def name(self) -> str:
        if self.bits == 8:
            return "int8"
        return f"int4 (groups of {self.group}{', zero points' if self.zero_point else ', symmetric'})"


def parse_expert_dtype(name: str, group: int = 32, zero_point: bool = False,
                       device: torch.device | str = "cpu") -> QuantFormat | None:
    """The QuantFormat for `--expert-dtype name` (None for a float dtype); clear errors for anything else."""
    if name not in EXPERT_DTYPES:
        raise ConfigError(f"unknown --expert-dtype '{name}'; choose from {', '.join(EXPERT_DTYPES)}")
    if name == "int8":
        return QuantFormat(8)
    if name == "int4":
        if group not in INT4_GROUPS:
            raise ConfigError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUPS))}, not {group}")
        return QuantFormat(4, group, zero_point, "cpu" if torch.device(device).type == "cpu" else "plain")
    return None


@dataclass(frozen=True)
class Section:
    offset: int
    """Bytes from the start of the buffer."""
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def sections(hidden: int, intermediate: int, dtype: torch.dtype, fmt: QuantFormat) -> tuple[list[Section], int]:
    """The buffer's sections (q gate_up, q down, gate_up scales, down scales) and its total size in bytes."""
    d, f = hidden, intermediate
    if fmt.bits == 8:
        parts = [(torch.int8, (2 * f, d)), (torch.int8, (d, f)), (dtype, (2 * f,)), (dtype, (d,))]
    elif fmt.layout == "rows":
        parts = [(torch.uint8, (2 * f, d // 2)), (torch.uint8, (d, f // 2)),
                 (dtype, (2 * f, d // fmt.group)), (dtype, (d, f // fmt.group))]
    else:
        parts = [(torch.uint8, (2 * f, d // 2)), (torch.uint8, (d, f // 2)),
                 (dtype, (d // fmt.group, 2 * f, 2)), (dtype, (f // fmt.group, d, 2))]
    out, at = [], 0
    for dt, shape in parts:
        s = Section(at, dt, shape)
        out.append(s)
        at = _align(at + s.nbytes)
    return out, at


def check_shape(hidden: int, intermediate: int, fmt: QuantFormat) -> None:
    """Refuse geometries the int4 kernels cannot take, saying why."""
    if fmt.bits != 4:
        return
    if fmt.layout == "rows" and fmt.zero_point:
        raise ConfigError("the int4 'rows' layout is symmetric (no zero points)")
    for name, k in (("hidden size", hidden), ("expert intermediate size", intermediate)):
        if k % fmt.group:
            raise ConfigError(f"int4 group size {fmt.group} does not divide the {name} {k}; choose a group from "
                              f"{', '.join(str(g) for g in INT4_GROUPS if k % g == 0) or 'none (use int8)'}")
    if fmt.layout == "cpu" and (hidden % 16 or 2 * intermediate % 16):
        raise ConfigError(f"int4 experts on the CPU need the hidden size ({hidden}) and twice the expert "
                          f"intermediate size ({2 * intermediate}) to be multiples of 16 (torch's int4 kernel); "
                          "use int8")


# ---- quantizing float weights ------------------------------------------------------------------------------


def _round_up_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, never below x (so no weight falls outside the integer range after rounding the scale)."""
    y = x.to(dtype)
    low = y.float() < x
    if low.any():
        y = torch.where(low, torch.nextafter(y.float(), torch.full_like(x, float("inf"))).to(dtype), y)
        y = torch.where(y.float() < x, (x * (1 + 2 ** -7)).to(dtype), y)
    return y


def quantize_int8(w_NK: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale [N] in `dtype`)."""
    w = w_NK.float()
    scale = _round_up_to(w.abs().amax(1).clamp(min=1e-12) / 127, dtype)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w_NK: torch.Tensor, group: int, zero_point: bool, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 in [0, 15] [N, K], scale [N, K/group], zero [N, K/group], both in `dtype`)."""
    n, k = w_NK.shape
    w = w_NK.float().reshape(n, k // group, group)
    if zero_point:
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12).to(dtype)
        zero = (lo + 8 * scale.float()).to(dtype)
    else:  # ggml's Q4_0: the value of largest magnitude maps to -8
        idx = w.abs().argmax(-1, keepdim=True)
        m = torch.gather(w, -1, idx)[..., 0]
        scale = torch.where(m == 0, torch.full_like(m, 1e-12), m / -8).to(dtype)
        zero = torch.zeros_like(scale)
    s, z = scale.float()[..., None], zero.float()[..., None]
    q = torch.round((w - z) / s + 8).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return q, scale, zero


def pack_nibbles(q_NK: torch.Tensor) -> torch.Tensor:
    """[N, K] values in [0, 15] -> [N, K/2] bytes, low nibble the even input index."""
    q = q_NK.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p_NH: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] bytes -> [..., N, K] values in [0, 15] (uint8)."""
    return torch.stack((p_NH & 15, p_NH >> 4), -1).flatten(-2)


@dataclass(frozen=True)
class Int4PackLayout:
    """A layout of torch's CPU int4 kernel: blocks of `block` output rows, each stored [K, block / 2] bytes, byte j
    holding two of the block's rows (low nibble, high nibble): rows j and j + block / 2 (`halves`), or 2j and 2j + 1."""

    block: int
    halves: bool


INT4PACK_LAYOUTS = (Int4PackLayout(64, True), Int4PackLayout(32, True), Int4PackLayout(32, False))
"""The layouts torch 2.x's `_convert_weight_to_int4pack_for_cpu` writes, by the kernel tier torch dispatches to on
this CPU (`torch.backends.cpu.get_cpu_capability()`): AVX512, AVX2 and DEFAULT, in that order (seen by probing torch
2.13 under ATEN_CPU_CAPABILITY=avx512 / avx2 / default)."""


def _pack_layout(p_NH: torch.Tensor, layout: Int4PackLayout) -> torch.Tensor:
    n, h = p_NH.shape
    half = layout.block // 2
    if layout.halves:
        block = p_NH.view(n // layout.block, 2, half, h)
        a, b = block[:, 0], block[:, 1]  # [blocks, half, K/2]: rows j and j + half
    else:
        block = p_NH.view(n // layout.block, half, 2, h)
        a, b = block[:, :, 0], block[:, :, 1]  # rows 2j and 2j + 1
    out = torch.empty(n // layout.block, h, 2, half, dtype=torch.uint8)
    out[:, :, 0] = ((a & 15) | (b << 4)).transpose(1, 2)  # input 2i: the first row low, the second high
    out[:, :, 1] = ((a >> 4) | (b & 0xF0)).transpose(1, 2)  # input 2i + 1
    return out.view(n, h)


@functools.lru_cache(maxsize=1)
def int4pack_layout() -> Int4PackLayout | None:
    """Which of INT4PACK_LAYOUTS torch's op writes in this process, found by packing a 64x64 probe both ways (None:
    none of them, and every int4 expert read calls the op). torch picks its kernel, and with it the layout, by the
    CPU it runs on: an AVX2 host's layout differs from an AVX-512 host's, and a layout assumed for the wrong one
    computes garbage."""
    q = torch.randint(0, 16, (64, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    plain = pack_nibbles(q)
    return next((layout for layout in INT4PACK_LAYOUTS
                 if want.shape == plain.shape and torch.equal(_pack_layout(plain, layout), want)), None)


def pack_int4_cpu(p_NH: torch.Tensor) -> torch.Tensor:
    """Plain nibbles [N, K/2] -> the layout of torch's CPU int4 kernel (`_convert_weight_to_int4pack_for_cpu`, probed:
    `int4pack_layout`). Written with tensor ops, an order of magnitude faster than that op, which every int4 expert
    read would pay; rows that do not fill whole blocks, and a layout the probe does not know, use the op."""
    n, _ = p_NH.shape
    layout = int4pack_layout()
    if layout is None or n % layout.block:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(p_NH).to(torch.int32), 1)
    return _pack_layout(p_NH, layout)


def dequantize_int4(q_NK: torch.Tensor, scale_NG: torch.Tensor, zero_NG: torch.Tensor) -> torch.Tensor:
    """Float32 weights [..., N, K] from unpacked int4 values and their group scales and zeros [..., N, K/g]."""
    g = q_NK.shape[-1] // scale_NG.shape[-1]
    w = (q_NK.float().unflatten(-1, (-1, g)) - 8) * scale_NG.float()[..., None] + zero_NG.float()[..., None]
    return w.flatten(-2)


def dequantize_rows(q_NH: torch.Tensor, s_NG: torch.Tensor) -> torch.Tensor:
    """Float32 weights [..., N, K] of plain int4 nibbles and row-major symmetric group scales [..., N, K/g] (the
    "rows" layout)."""
    return dequantize_int4(unpack_nibbles(q_NH), s_NG, torch.zeros_like(s_NG))


def dequantize_buffer_int4(q_NH: torch.Tensor, s: torch.Tensor, layout: str) -> torch.Tensor:
    """Float32 weights of one projection (or a stack) as an expert buffer holds them, plain or rows layout."""
    return dequantize_rows(q_NH, s) if layout == "rows" else dequantize_plain(q_NH, s)


def dequantize_plain(q_NH: torch.Tensor, s_GN2: torch.Tensor) -> torch.Tensor:
    """Float32 weights [..., N, K] of plain int4 nibbles [..., N, K/2] and the scales and zeros an expert buffer
    stores beside them, [..., K/g, N, 2] (one projection, or a stack of them)."""
    s_NG2 = s_GN2.transpose(-3, -2)
    return dequantize_int4(unpack_nibbles(q_NH), s_NG2[..., 0], s_NG2[..., 1])


def projection_tensors(fmt: QuantFormat, n: int, k: int, dtype: torch.dtype
                       ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The stored tensors of one [N, K] projection in checkpoint form: (name suffix, dtype, shape) of the
    integers, the scales in `dtype` and, for int4 with zero points, the zeros."""
    if fmt.bits == 8:
        return [("", torch.int8, (n, k)), ("_scale", dtype, (n,))]
    parts = [("", torch.uint8, (n, k // 2)), ("_scale", dtype, (n, k // fmt.group))]
    return parts + [("_zero", dtype, (n, k // fmt.group))] if fmt.zero_point else parts


@dataclass
class QuantizedProjection:
    """One projection in checkpoint form: int8 q [N, K] or int4 packed nibbles [N, K/2], scales, zeros."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    @classmethod
    def empty(cls, fmt: QuantFormat, n: int, k: int, dtype: torch.dtype) -> QuantizedProjection:
        return cls(*(torch.empty(shape, dtype=dt) for _, dt, shape in projection_tensors(fmt, n, k, dtype)))

    def tensor(self, suffix: str) -> torch.Tensor | None:
        """The tensor stored under the projection's name + `suffix` ("", "_scale" or "_zero")."""
        return {"": self.q, "_scale": self.scale, "_zero": self.zero}[suffix]


def quantize_projection(w_NK: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> QuantizedProjection:
    if fmt.bits == 8:
        return QuantizedProjection(*quantize_int8(w_NK, dtype))
    q, scale, zero = quantize_int4(w_NK, fmt.group, fmt.zero_point, dtype)
    return QuantizedProjection(pack_nibbles(q), scale, zero if fmt.zero_point else None)


def dequantize_projection(p: QuantizedProjection, fmt: QuantFormat) -> torch.Tensor:
    """Float32 weights of a projection in checkpoint form."""
    if fmt.bits == 8:
        return p.q.float() * p.scale.float()[:, None]
    zero = p.zero if p.zero is not None else torch.zeros_like(p.scale)
    return dequantize_int4(unpack_nibbles(p.q), p.scale, zero)


# ---- an expert's buffer -------------------------------------------------------------------------------------


def int8_mm(x_TK: torch.Tensor, q_NK: torch.Tensor, scale_N: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale)^T for int8 weights with one scale per output row: the packed GEMV kernel up to
    INT8_PACKED_MAX_TOKENS tokens on the CPU, else dequantised to x's dtype and one GEMM (see the module note)."""
    # torch 2.13's kernel on bf16 inputs whose length is not a multiple of 16 returns NaN or garbage, or crashes
    # the process (probed over lengths 8-136 and 1-32 tokens; fp16 and fp32 are right): those dequantise
    if x_TK.shape[0] <= INT8_PACKED_MAX_TOKENS and not x_TK.is_cuda and not (
            x_TK.dtype == torch.bfloat16 and x_TK.shape[1] % 16):
        return torch.ops.aten._weight_int8pack_mm(x_TK, q_NK, scale_N)
    return F.linear(x_TK, q_NK.to(x_TK.dtype) * scale_N[:, None])


VNNI = torch.cpu._is_vnni_supported()
"""Whether FBGEMM sums u8 x s8 products straight into int32 (AVX512-VNNI). Without it pairs are summed in int16,
which 8-bit activations can saturate: there it quantizes them to 7 bits (its `reduce_range`)."""


def int8_packing_available() -> bool:
    """Whether this torch build has the x86 quantized engine (FBGEMM) behind `quantized.linear_dynamic`."""
    engines = torch.backends.quantized.supported_engines
    return torch.backends.quantized.engine in ("x86", "fbgemm") and "fbgemm" in engines


def int8_prepack(q_NK: torch.Tensor, scale_N: torch.Tensor) -> torch.Tensor:
    """int8 weights with one scale per output row, prepacked for `int8_packed_mm` (an opaque FBGEMM object, a
    copy; the scales are exact in float64)."""
    zeros = torch.zeros(q_NK.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors; FBGEMM's packing still takes one
        warnings.simplefilter("ignore", UserWarning)
        w = torch._make_per_channel_quantized_tensor(q_NK, scale_N.double(), zeros, 0)
    return torch.ops.quantized.linear_prepack(w, None)


def int8_packed_mm(x_TK: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale)^T for weights prepacked by `int8_prepack`, with each row of x quantized to 8 bits on the
    fly: FBGEMM's u8 x s8 dot products (AVX512-VNNI: no int16 saturation, tested; 7-bit activations without it)
    instead of converting each weight to float. Lossy beyond the weights' own quantization; the `packed` expert
    kernel's int8 path (experts/executor.py). FBGEMM quantizes a call's input with one scale and zero point (its
    min and max); rows divided by their own absmax first, and the outputs multiplied back, make that one scale per
    row (per token: what one-token decode steps get anyway), so a prefill's small rows keep their resolution."""
    x, reduce = x_TK.float(), not VNNI
    if x.shape[0] == 1:
        return torch.ops.quantized.linear_dynamic(x, packed, reduce).to(x_TK.dtype)
    a_T1 = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (torch.ops.quantized.linear_dynamic(x / a_T1, packed, reduce) * a_T1).to(x_TK.dtype)


class QuantExpertWeights:
    """Views into a quantized expert's byte buffer, and its two projections as callables on [T, K] inputs."""

    __slots__ = ("buffer", "fmt", "q_gate_up", "q_down", "s_gate_up", "s_down", "_dim")

    def __init__(self, buffer: torch.Tensor, hidden: int, intermediate: int, dtype: torch.dtype, fmt: QuantFormat):
        secs, nbytes = sections(hidden, intermediate, dtype, fmt)
        if buffer.dim() != 1 or buffer.dtype != torch.uint8 or buffer.numel() != nbytes:
            raise ValueError(f"a {fmt.name} expert buffer must be 1-D uint8 of {nbytes} bytes")
        self.buffer, self.fmt = buffer, fmt
        q_gu, q_dn, s_gu, s_dn = (buffer[s.offset: s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in secs)
        self.q_gate_up, self.q_down, self.s_gate_up, self.s_down = q_gu, q_dn, s_gu, s_dn
        self._dim = (hidden, intermediate)

    def gate_up(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self._mm(x_TD, self.q_gate_up, self.s_gate_up)

    def down(self, x_TF: torch.Tensor) -> torch.Tensor:
        return self._mm(x_TF, self.q_down, self.s_down)

    def _mm(self, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        fmt = self.fmt
        if fmt.bits == 8:
            return int8_mm(x, q, s)
        if fmt.layout == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, fmt.group, s)
        return F.linear(x, dequantize_buffer_int4(q, s, fmt.layout).to(x.dtype))

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 (gate_up [2F, D], down [D, F]): what the kernels compute with (for tests)."""
        d, f = self._dim
        if self.fmt.bits == 8:
            return (self.q_gate_up.float() * self.s_gate_up.float()[:, None],
                    self.q_down.float() * self.s_down.float()[:, None])
        eye_d, eye_f = torch.eye(d, dtype=self.s_gate_up.dtype), torch.eye(f, dtype=self.s_gate_up.dtype)
        return self.gate_up(eye_d).float().t(), self.down(eye_f).float().t()

    def store(self, gate_up: QuantizedProjection, down: QuantizedProjection) -> None:
        """Fill the buffer from the two projections in checkpoint form (int4: repacked for the CPU kernel)."""
        for proj, q, s in ((gate_up, self.q_gate_up, self.s_gate_up), (down, self.q_down, self.s_down)):
            if self.fmt.bits == 8:
                q.copy_(proj.q)
                s.copy_(proj.scale)
                continue
            if self.fmt.layout == "cpu":
                q.copy_(pack_int4_cpu(proj.q))
            else:
                q.copy_(proj.q)
            if self.fmt.layout == "rows":
                if proj.zero is not None:
                    raise ValueError("the int4 'rows' layout is symmetric: these groups have zero points")
                s.copy_(proj.scale)
                continue
            s[..., 0].copy_(proj.scale.t())
            if proj.zero is None:
                s[..., 1].zero_()
            else:
                s[..., 1].copy_(proj.zero.t())


def quantize_expert(gate_up_2FD: torch.Tensor, down_DF: torch.Tensor, out: QuantExpertWeights,
                    dtype: torch.dtype) -> None:
    """Quantize one float expert into `out`'s buffer."""
    fmt = out.fmt
    out.store(quantize_projection(gate_up_2FD, fmt, dtype), quantize_projection(down_DF, fmt, dtype))
