// Weight rows of moepager's CPU kernels (cpu_moe.cpp, cpu_step.cpp): the expert formats, the activations quantized
// for the integer ones, and the dot products of a block of weight rows with a few inputs.
//
// Formats of one expert's flat buffer (experts/weights.py, experts/quant.py), byte offsets given by the caller:
// - bf16: gate_up [2F, D] then down [D, F], bf16. Dot products by AVX512-BF16 (vdpbf16ps: pairs of bf16
//   products summed into fp32).
// - int8: q gate_up [2F, D] int8, q down [D, F] int8, one bf16 scale per output row. The activations are
//   quantized to int8 in blocks of 32 with one fp32 scale each (llama.cpp's Q8_0 activations) and dotted with
//   VNNI (vpdpbusd: |x| as u8 times the weight with x's sign, four products summed into int32).
// - int4, the "rows" layout (experts/quant.py): plain nibbles (low nibble = even input index; a GGUF Q4_0 block is the
//   same bytes up to the order of nibbles within the block), [N, K/2] per projection, symmetric groups of g (32, 64
//   or 128) with one bf16 scale per group, row-major [N, K/g]: w = (q - 8) * s. The activations are
//   quantized as for int8, split within each block into even and odd inputs (the nibbles' order), and dotted
//   with VNNI (the nibbles as u8 times x as s8; the -8 folded in as -8 * sum(x) per block).
//
// Every output element is one dot product accumulated in 16 fp32 lanes over the input in order, then summed across
// lanes, whatever the thread that computes it.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_simd.h"

namespace {

enum Format : int64_t { BF16 = 0, INT8 = 1, INT4 = 2 };

struct Spec {
  int64_t fmt, D, F, group;
  int64_t off_gu, off_dn, off_sgu, off_sdn;  // bytes from the start of an expert's buffer
};

Spec parse_spec(const std::vector<int64_t>& s) {
  TORCH_CHECK(s.size() == 8, "spec: fmt, D, F, group, off_gu, off_dn, off_sgu, off_sdn");
  Spec p{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]};
  TORCH_CHECK(p.fmt >= 0 && p.fmt <= 2, "unknown expert format ", p.fmt);
  if (p.fmt == INT4) TORCH_CHECK((p.group == 32 || p.group == 64 || p.group == 128) && p.D % p.group == 0 &&
                                 p.F % p.group == 0, "int4 groups must be 32, 64 or 128 and divide D and F");
  return p;
}

// ---- activations quantized for the integer formats ------------------------------------------------------------
// Per 64 inputs (a chunk): 64 bytes of values (int8: |x| as u8; int4: x as s8 permuted to the nibbles' order), a
// 64-bit sign mask (int8), 16 int32 lanes of the -8 * sum(x) correction (int4) and 16 fp32 lanes of block scales
// ([scale of block 0] x 8, [scale of block 1] x 8). Inputs past K are zero.
struct QRow {
  uint8_t* q;
  uint64_t* sign;
  int32_t* corr;
  float* scale;
};

inline int64_t chunk_inputs(int64_t fmt) { return fmt == INT4 ? 128 : 64; }

struct QBuffer {
  int64_t chunks = 0, width = 64;
  std::vector<uint8_t> q;
  std::vector<uint64_t> sign;
  std::vector<int32_t> corr;
  std::vector<float> scale;
  void resize(int64_t rows, int64_t k, int64_t fmt) {
    width = chunk_inputs(fmt);
    chunks = (k + width - 1) / width;
    q.assign(rows * chunks * width, 0);
    sign.assign(rows * chunks, 0);
    corr.assign(rows * chunks * 16, 0);
    scale.assign(rows * chunks * 16, 0.f);
  }
  QRow row(int64_t r) {
    return {q.data() + r * chunks * width, sign.data() + r * chunks, corr.data() + r * chunks * 16,
            scale.data() + r * chunks * 16};
  }
};

// Quantize one chunk (n valid inputs of src: up to 64 for int8, 128 for int4) into chunk c of `out`, in blocks of 32
// with one scale each. int8: |x| as u8 and a sign bit per input; scale lanes [block 0] x 8, [block 1] x 8. int4: x as
// s8, each block's even inputs in bytes 16j.. of the first 64 and its odd ones in the second 64; -8 * sum(x) of block
// j in int32 lane 4j; scale lanes 4j..4j+3 block j's.
inline void quantize_chunk(const float* src, int64_t n, int64_t fmt, QRow out, int64_t c) {
  const int64_t blocks = chunk_inputs(fmt) / 32, lanes = 16 / blocks;
  uint8_t* q = out.q + c * chunk_inputs(fmt);
  int32_t* corr = out.corr + c * 16;
  float* sc = out.scale + c * 16;
  uint64_t sign = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * 32, hi = std::min<int64_t>(n, lo + 32);
    float amax = 0.f;
    for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(src[i]));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    int8_t v[32] = {0};
    for (int64_t i = lo; i < hi; ++i) {
      v[i - lo] = static_cast<int8_t>(std::nearbyint(src[i] * inv));
      sum += v[i - lo];
    }
    for (int64_t j = 0; j < lanes; ++j) {
      sc[b * lanes + j] = d;
      corr[b * lanes + j] = 0;
    }
    if (fmt == INT8) {
      for (int i = 0; i < 32; ++i) {
        q[lo + i] = static_cast<uint8_t>(v[i] < 0 ? -v[i] : v[i]);
        if (v[i] < 0) sign |= uint64_t(1) << (lo + i);
      }
    } else {
      for (int i = 0; i < 16; ++i) {
        q[16 * b + i] = static_cast<uint8_t>(v[2 * i]);
        q[64 + 16 * b + i] = static_cast<uint8_t>(v[2 * i + 1]);
      }
      corr[b * lanes] = -8 * sum;
    }
  }
  out.sign[c] = sign;
}

void quantize_row(const float* src, int64_t k, int64_t fmt, QRow out) {
  const int64_t w = chunk_inputs(fmt);
  for (int64_t c = 0; c * w < k; ++c) quantize_chunk(src + c * w, std::min<int64_t>(w, k - c * w), fmt, out, c);
}

// ---- dot products of R weight rows with T inputs: out[t][r] --------------------------------------------------

inline __m512i load_tail_i8(const int8_t* p, int64_t n) {  // n >= 1 bytes
  return n >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(static_cast<__mmask64>((1ull << n) - 1), p);
}

template <int T>
inline __m512 int8_chunk(__m512i wv, const QRow* x, int64_t c, int t, __m512 acc) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i ws = _mm512_mask_sub_epi8(wv, static_cast<__mmask64>(x[t].sign[c]), zero, wv);
  const __m512i d = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512(x[t].q + c * 64), ws);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(x[t].scale + c * 16), acc);
}

template <int T>
inline void dot_int8(const int8_t* w, const QRow* x, int64_t K, float* out) {
  __m512 a0[T], a1[T];
  for (int t = 0; t < T; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; (c + 2) * 64 <= K; c += 2) {
    prefetch_l2(w + c * 64 + PREFETCH);
    const __m512i w0 = _mm512_loadu_si512(w + c * 64), w1 = _mm512_loadu_si512(w + c * 64 + 64);
    for (int t = 0; t < T; ++t) {
      a0[t] = int8_chunk<T>(w0, x, c, t, a0[t]);
      a1[t] = int8_chunk<T>(w1, x, c + 1, t, a1[t]);
    }
  }
  for (; c * 64 < K; ++c) {
    const __m512i wv = load_tail_i8(w + c * 64, K - c * 64);
    for (int t = 0; t < T; ++t) a0[t] = int8_chunk<T>(wv, x, c, t, a0[t]);
  }
  for (int t = 0; t < T; ++t) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}

// int4 ("rows" layout): w points at the row's K/2 bytes of plain nibbles, s at its K/g bf16 group scales. A chunk is
// 128 inputs: 64 bytes of nibbles, four blocks of 32, block j in 128-bit lane j (low nibbles: its even inputs, high:
// its odd ones), dotted against the activations' evens and odds laid out the same way (QBuffer for INT4). A group
// (32, 64 or 128: parse_spec) divides a chunk, so chunk c's scales are the 128 / g from c * 128 / g on.
inline __m512 int4_scales(const uint16_t* s, __mmask8 m, __m512i scale_index) {  // lane i: its block's group scale
  const __m128i sc = _mm_maskz_loadu_epi16(m, s);
  return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, scale_index, _mm512_castsi128_si512(sc)));
}

template <int T>
inline void int4_chunk(__m512i wv, __m512 sv, const QRow* x, int64_t c, __m512* acc) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i lo = _mm512_and_si512(wv, low4), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low4);
  for (int t = 0; t < T; ++t) {
    const uint8_t* xq = x[t].q + c * 128;
    __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512(x[t].corr + c * 16), lo, _mm512_loadu_si512(xq));
    d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(xq + 64));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(_mm512_loadu_ps(x[t].scale + c * 16), sv), acc[t]);
  }
}

template <int T>
inline void dot_int4(const uint8_t* w, const uint16_t* s, int64_t group, const QRow* x, int64_t K, float* out,
                     __m512i scale_index) {
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t per = 128 / group, full = K / 128;  // scales a chunk, whole chunks
  const __mmask8 all = static_cast<__mmask8>((1u << per) - 1);
  for (int64_t c = 0; c < full; ++c) {
    prefetch_l2(w + c * 64 + PREFETCH);
    int4_chunk<T>(_mm512_loadu_si512(w + c * 64), int4_scales(s + c * per, all, scale_index), x, c, acc);
  }
  if (const int64_t left = K - full * 128; left > 0) {  // a multiple of the group: its groups only
    const __mmask8 m = static_cast<__mmask8>((1u << (left / group)) - 1);
    const __m512i wv = _mm512_maskz_loadu_epi8(static_cast<__mmask64>((1ull << (left / 2)) - 1), w + full * 64);
    int4_chunk<T>(wv, int4_scales(s + full * per, m, scale_index), x, full, acc);
  }
  for (int t = 0; t < T; ++t) out[t] = _mm512_reduce_add_ps(acc[t]);
}

// The permutation `dot_int4` expands a chunk's (up to) four group scales with: 16-bit element 2i + 1 takes scale
// (block i / 4) * 32 / group of the loaded ones; the even elements are zeroed by the mask.
inline __m512i int4_scale_index(int64_t group) {
  alignas(64) int16_t idx[32] = {0};
  for (int i = 0; i < 16; ++i) idx[2 * i + 1] = static_cast<int16_t>((i / 4) * 32 / group);
  return _mm512_load_si512(idx);
}

// ---- one projection over a block of rows: y[t * ldy + r] for rows r0..r1 -------------------------------------
// `xb` (bf16 inputs) or `xq` (quantized inputs), one per token, n tokens in all.
struct Projection {
  const uint8_t* w;       // row 0
  const uint16_t* scale;  // int8: [N] per-row scales; int4: [N, K/g] group scales
  int64_t N, K;
};

template <int T>
inline void row_dot(int64_t fmt, const Projection& p, int64_t group, int64_t r, const uint16_t* const* xb,
                    const QRow* xq, float* out, __m512i scale_index) {
  if (fmt == BF16) {
    dot_bf16<T>(reinterpret_cast<const uint16_t*>(p.w) + r * p.K, xb, p.K, out);
  } else if (fmt == INT8) {
    dot_int8<T>(reinterpret_cast<const int8_t*>(p.w) + r * p.K, xq, p.K, out);
    const float sc = bf16_to_float(p.scale[r]);
    for (int t = 0; t < T; ++t) out[t] *= sc;
  } else {
    dot_int4<T>(p.w + r * (p.K / 2), p.scale + r * (p.K / group), group, xq, p.K, out, scale_index);
  }
}

void rows_any(int64_t fmt, const Projection& p, int64_t group, int64_t r0, int64_t r1, const uint16_t* const* xb,
              const QRow* xq, int64_t n, float* y, int64_t ldy) {
  const __m512i scale_index = fmt == INT4 ? int4_scale_index(group) : _mm512_setzero_si512();
  float tmp[4];
  for (int64_t t = 0; t < n; t += 4) {
    const int64_t c = std::min<int64_t>(4, n - t);
    const uint16_t* const* xbt = xb ? xb + t : nullptr;
    const QRow* xqt = xq ? xq + t : nullptr;
    for (int64_t r = r0; r < r1; ++r) {
      switch (c) {
        case 4: row_dot<4>(fmt, p, group, r, xbt, xqt, tmp, scale_index); break;
        case 3: row_dot<3>(fmt, p, group, r, xbt, xqt, tmp, scale_index); break;
        case 2: row_dot<2>(fmt, p, group, r, xbt, xqt, tmp, scale_index); break;
        default: row_dot<1>(fmt, p, group, r, xbt, xqt, tmp, scale_index); break;
      }
      for (int64_t i = 0; i < c; ++i) y[(t + i) * ldy + r] = tmp[i];
    }
  }
}

// ---- SiLU(gate) * up, vectorized ------------------------------------------------------------------------------

inline void swiglu(const float* g, const float* u, float* h, int64_t n) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    _mm512_storeu_ps(h + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    _mm512_mask_storeu_ps(h + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
  }
}

// Rows r0..r1 of y = x W^T for T inputs (bf16 rows xb, or quantized rows xq) against the N rows of `p`: fp32 into
// y [T, N], rounded to bf16 into out [T, N] (the dense GEMV's task).
inline void gemv_rows(int64_t fmt, const Projection& p, const uint16_t* const* xb, const QRow* xq, int64_t T,
                      int64_t r0, int64_t r1, float* y, uint16_t* out) {
  rows_any(fmt, p, 0, r0, r1, xb, xq, T, y, p.N);
  for (int64_t t = 0; t < T; ++t) to_bf16(y + t * p.N + r0, out + t * p.N + r0, r1 - r0);
}

}  // namespace
