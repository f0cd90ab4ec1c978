// moepager's CPU expert kernels: one call per MoE layer (gate+up, SiLU, down, routing-weighted sum) for a few
// tokens, reading the weights at the memory-bandwidth limit. Built at first use by accel/cpu_kernels.py
// (torch.utils.cpp_extension, -march=native) on CPUs with AVX512-BF16 and AVX512-VNNI; elsewhere that module
// falls back to the torch kernels and says so.
//
// Formats of one expert's flat buffer (experts/weights.py, experts/quant.py), byte offsets given by the caller:
// - bf16: gate_up [2F, D] then down [D, F], bf16. Dot products by AVX512-BF16 (vdpbf16ps: pairs of bf16
//   products summed into fp32).
// - int8: q gate_up [2F, D] int8, q down [D, F] int8, one bf16 scale per output row. The activations are
//   quantized to int8 in blocks of 32 with one fp32 scale each (llama.cpp's Q8_0 activations) and dotted with
//   VNNI (vpdpbusd: |x| as u8 times the weight with x's sign, four products summed into int32).
// - int4, the "rows" layout (experts/quant.py): plain nibbles (low nibble = even input index; a GGUF Q4_0 block is the
//   same bytes up to the order of nibbles within the block), [N, K/2] per projection, symmetric groups of g (a
//   multiple of 32) with one bf16 scale per group, row-major [N, K/g]: w = (q - 8) * s. The activations are
//   quantized as for int8, split within each block into even and odd inputs (the nibbles' order), and dotted
//   with VNNI (the nibbles as u8 times x as s8; the -8 folded in as -8 * sum(x) per block).
//
// Order of arithmetic (fixed, whatever the thread count): each output element is one dot product accumulated in
// 16 fp32 lanes over the input in order, then summed across lanes; a pair's (token, k) expert output is scaled by
// its routing weight in fp32 (y rows); a token's output sums its y rows in sorted (ascending expert id) order in
// fp32 and is rounded to bf16 once. `moe_partial` + `moe_combine` (paged layers, computed as experts land) and
// `moe_resident` (one call) run the same code, so they agree bit for bit.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

// ---- one MoE layer's experts ----------------------------------------------------------------------------------

struct Group {
  const uint8_t* buf;  // the expert's flat buffer
  int64_t begin, end;  // its sorted (token, k) pairs
};

constexpr int64_t TILE_F = 128;  // gate/up rows per task (a multiple of 128: whole activation chunks)
constexpr int64_t TILE_D = 64;  // down rows per task (long streams per expert: 64 rows of 768 bf16 are 96 KiB)

Projection gate_up_of(const Spec& s, const uint8_t* buf) {
  return {buf + s.off_gu, reinterpret_cast<const uint16_t*>(buf + s.off_sgu), 2 * s.F, s.D};
}
Projection down_of(const Spec& s, const uint8_t* buf) {
  return {buf + s.off_dn, reinterpret_cast<const uint16_t*>(buf + s.off_sdn), s.D, s.F};
}

// Each token's output for columns d0..d1: the sum of its y rows in sorted order in fp32, rounded to bf16 once. The one
// reduction both `moe_resident` and `moe_combine` run, so a paged layer equals a resident one bit for bit.
void combine_tile(const float* y, const int64_t* token, int64_t M, int64_t N, int64_t D, int64_t d0, int64_t d1,
                  uint16_t* out, std::vector<float>& acc) {
  const int64_t w = d1 - d0;
  acc.assign(N * w, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t d = d0; d < d1; ++d) acc[token[m] * w + d - d0] += y[m * D + d];
  for (int64_t t = 0; t < N; ++t) to_bf16(acc.data() + t * w, out + t * D + d0, w);
}

// Every row of bf16 x [T, K] quantized for the integer formats (once per call: each row serves many weight rows).
void quantize_inputs(const uint16_t* x, int64_t T, int64_t K, int64_t fmt, QBuffer& xq) {
  xq.resize(T, K, fmt);
  at::parallel_for(0, T, grain_for(T, T * K * 16), [&](int64_t a, int64_t b) {  // (~16 operations an input)
    std::vector<float> row(K);
    for (int64_t t = a; t < b; ++t) {
      for (int64_t i = 0; i < K; ++i) row[i] = bf16_to_float(x[t * K + i]);
      quantize_row(row.data(), K, fmt, xq.row(t));
    }
  });
}

// The y rows (fp32 [M, D], routing-weighted) of every pair of `groups`; with `out` (bf16 [N, D]) also each token's
// sum of its rows (then `groups` are all of the layer's pairs).
void run_layer(const Spec& s, const uint16_t* x, int64_t N, const std::vector<Group>& groups, const int64_t* token,
               const float* weight, float* y, uint16_t* out) {
  const int64_t D = s.D, F = s.F, fmt = s.fmt;
  int64_t M = 0;
  for (const auto& g : groups) M = std::max(M, g.end);
  // inputs: bf16 rows as they are, or quantized once per token
  QBuffer xq;
  if (fmt != BF16) quantize_inputs(x, N, D, fmt, xq);
  // phase 1: gate and up rows, SiLU(gate) * up -> h (bf16 rows, or quantized rows), one task per (group, F tile)
  std::vector<uint16_t> hb(fmt == BF16 ? M * F : 0);
  QBuffer hq;
  if (fmt != BF16) hq.resize(M, F, fmt);
  const int64_t tiles_f = (F + TILE_F - 1) / TILE_F;
  const int64_t G = static_cast<int64_t>(groups.size());
  const int64_t macs = M * 3 * D * F;
  at::parallel_for(0, G * tiles_f, grain_for(G * tiles_f, macs), [&](int64_t a, int64_t b) {
    std::vector<float> gate, up, h;
    std::vector<const uint16_t*> xb;
    std::vector<QRow> xr;
    for (int64_t task = a; task < b; ++task) {
      const Group& g = groups[task / tiles_f];
      const int64_t f0 = (task % tiles_f) * TILE_F, f1 = std::min(F, f0 + TILE_F), n = g.end - g.begin;
      if (n <= 0) continue;
      const Projection p = gate_up_of(s, g.buf);
      xb.clear();
      xr.clear();
      for (int64_t m = g.begin; m < g.end; ++m) {
        if (fmt == BF16) xb.push_back(x + token[m] * D);
        else xr.push_back(xq.row(token[m]));
      }
      gate.assign(n * TILE_F, 0.f);
      up.assign(n * TILE_F, 0.f);
      h.assign(n * TILE_F, 0.f);
      // the tile's gate rows f0..f1, then its up rows F + f0..F + f1 (two long streams, not alternating 16-row runs:
      // the prefetchers run on into rows the task reads next), written at column r - f0 of the tile's rows
      rows_any(fmt, p, s.group, f0, f1, fmt == BF16 ? xb.data() : nullptr, fmt == BF16 ? nullptr : xr.data(), n,
               gate.data() - f0, TILE_F);
      rows_any(fmt, p, s.group, F + f0, F + f1, fmt == BF16 ? xb.data() : nullptr, fmt == BF16 ? nullptr : xr.data(),
               n, up.data() - F - f0, TILE_F);
      for (int64_t i = 0; i < n; ++i) {
        float* hi = h.data() + i * TILE_F;
        swiglu(gate.data() + i * TILE_F, up.data() + i * TILE_F, hi, f1 - f0);
        const int64_t m = g.begin + i;
        if (fmt == BF16) {
          to_bf16(hi, hb.data() + m * F + f0, f1 - f0);
        } else {
          const QRow row = hq.row(m);
          const int64_t w = chunk_inputs(fmt);
          for (int64_t c = f0 / w; c * w < f1; ++c)
            quantize_chunk(hi + (c * w - f0), std::min<int64_t>(w, f1 - c * w), fmt, row, c);
        }
      }
    }
  });
  // phase 2: down rows of every group, one task per D tile; then (with `out`) each token's sum for the tile
  const int64_t tiles_d = (D + TILE_D - 1) / TILE_D;
  at::parallel_for(0, tiles_d, grain_for(tiles_d, macs), [&](int64_t a, int64_t b) {
    std::vector<const uint16_t*> hbr;
    std::vector<QRow> hqr;
    std::vector<float> acc;
    for (int64_t task = a; task < b; ++task) {
      const int64_t d0 = task * TILE_D, d1 = std::min(D, d0 + TILE_D);
      for (const auto& g : groups) {
        const int64_t n = g.end - g.begin;
        if (n <= 0) continue;
        hbr.clear();
        hqr.clear();
        for (int64_t m = g.begin; m < g.end; ++m) {
          if (fmt == BF16) hbr.push_back(hb.data() + m * F);
          else hqr.push_back(hq.row(m));
        }
        rows_any(fmt, down_of(s, g.buf), s.group, d0, d1, fmt == BF16 ? hbr.data() : nullptr,
                 fmt == BF16 ? nullptr : hqr.data(), n, y + g.begin * D, D);
        for (int64_t m = g.begin; m < g.end; ++m)
          for (int64_t d = d0; d < d1; ++d) y[m * D + d] *= weight[m];
      }
      if (out != nullptr) combine_tile(y, token, M, N, D, d0, d1, out, acc);
    }
  });
}

void check_x(const torch::Tensor& x, const Spec& s) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.size(1) == s.D,
              "x must be contiguous bf16 [N, ", s.D, "]");
}

std::vector<Group> groups_of(const torch::Tensor& arena, const torch::Tensor& rows, const torch::Tensor& spans) {
  TORCH_CHECK(arena.dim() == 2 && arena.stride(1) == 1, "the arena must be [rows, numel] with contiguous rows");
  const auto* base = static_cast<const uint8_t*>(arena.data_ptr());
  const int64_t stride = arena.stride(0) * arena.element_size();
  auto r = rows.contiguous();
  auto sp = spans.contiguous();
  TORCH_CHECK(r.scalar_type() == torch::kLong && sp.scalar_type() == torch::kLong && sp.dim() == 2 &&
              sp.size(0) == r.size(0) && sp.size(1) == 2, "rows [G] and spans [G, 2] must be int64");
  std::vector<Group> groups;
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* spp = sp.data_ptr<int64_t>();
  for (int64_t g = 0; g < r.size(0); ++g) {
    TORCH_CHECK(rp[g] >= 0 && rp[g] < arena.size(0), "arena row ", rp[g], " out of range");
    groups.push_back({base + rp[g] * stride, spp[2 * g], spp[2 * g + 1]});
  }
  return groups;
}

}  // namespace

// The y rows of the given groups of sorted pairs (paged layers compute the experts that have landed).
void moe_partial(const torch::Tensor& x, const torch::Tensor& arena, const torch::Tensor& token,
                 const torch::Tensor& weight, const torch::Tensor& rows, const torch::Tensor& spans, torch::Tensor& y,
                 const std::vector<int64_t>& spec) {
  const Spec s = parse_spec(spec);
  check_x(x, s);
  TORCH_CHECK(token.scalar_type() == torch::kLong && token.is_contiguous() && weight.scalar_type() == torch::kFloat &&
              weight.is_contiguous() && token.numel() == weight.numel(), "token [M] int64 and weight [M] fp32");
  TORCH_CHECK(y.scalar_type() == torch::kFloat && y.is_contiguous() && y.dim() == 2 && y.size(0) == token.numel() &&
              y.size(1) == s.D, "y must be contiguous fp32 [M, D]");
  auto groups = groups_of(arena, rows, spans);
  for (const auto& g : groups) TORCH_CHECK(g.begin >= 0 && g.end <= token.numel() && g.begin <= g.end, "bad span");
  const int64_t* tp = token.data_ptr<int64_t>();
  for (int64_t m = 0; m < token.numel(); ++m) TORCH_CHECK(tp[m] >= 0 && tp[m] < x.size(0), "token index out of range");
  pybind11::gil_scoped_release release;  // the store's loader threads run meanwhile
  run_layer(s, reinterpret_cast<const uint16_t*>(x.data_ptr()), x.size(0), groups, tp, weight.data_ptr<float>(),
            y.data_ptr<float>(), nullptr);
}

// Each token's output: the sum of its y rows in sorted order, rounded to bf16 once (what moe_resident computes).
torch::Tensor moe_combine(const torch::Tensor& y, const torch::Tensor& token, int64_t n) {
  TORCH_CHECK(y.scalar_type() == torch::kFloat && y.is_contiguous() && y.dim() == 2 && token.is_contiguous() &&
              token.scalar_type() == torch::kLong && token.numel() == y.size(0), "y [M, D] fp32 and token [M] int64");
  const int64_t D = y.size(1), M = y.size(0);
  auto out = torch::empty({n, D}, y.options().dtype(torch::kBFloat16));
  const float* yp = y.data_ptr<float>();
  const int64_t* tp = token.data_ptr<int64_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t tiles = (D + TILE_D - 1) / TILE_D;
  pybind11::gil_scoped_release release;
  at::parallel_for(0, tiles, grain_for(tiles, M * D * 16), [&](int64_t a, int64_t b) {  // (M * D adds: as ~16 MACs)
    std::vector<float> acc;
    for (int64_t task = a; task < b; ++task)
      combine_tile(yp, tp, M, n, D, task * TILE_D, std::min(D, task * TILE_D + TILE_D), op, acc);
  });
  return out;
}

// One resident layer in one call: experts e at arena rows base + e; the (token, k) pairs sorted by expert
// (stable) here, their outputs weighted and summed per token.
torch::Tensor moe_resident(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                           const torch::Tensor& arena, int64_t base, int64_t num_experts,
                           const std::vector<int64_t>& spec) {
  const Spec s = parse_spec(spec);
  check_x(x, s);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && weights.sizes() == ids.sizes(), "ids and weights [N, K]");
  auto id = ids.to(torch::kLong).contiguous();
  auto w = weights.to(torch::kFloat).contiguous();
  const int64_t N = ids.size(0), K = ids.size(1), M = N * K;
  const int64_t* ip = id.data_ptr<int64_t>();
  std::vector<int64_t> count(num_experts + 1, 0);
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < num_experts, "expert id ", ip[i], " out of range");
    ++count[ip[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) count[e + 1] += count[e];
  std::vector<int64_t> token(M), fill(count.begin(), count.end() - 1);
  std::vector<float> weight(M);
  const float* wp = w.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i) {  // counting sort: stable
    const int64_t at = fill[ip[i]]++;
    token[at] = i / K;
    weight[at] = wp[i];
  }
  TORCH_CHECK(arena.dim() == 2 && arena.stride(1) == 1 && base >= 0 && base + num_experts <= arena.size(0),
              "arena rows base..base + num_experts out of range");
  const auto* abase = static_cast<const uint8_t*>(arena.data_ptr());
  const int64_t stride = arena.stride(0) * arena.element_size();
  std::vector<Group> groups;
  for (int64_t e = 0; e < num_experts; ++e)
    if (count[e + 1] > count[e]) groups.push_back({abase + (base + e) * stride, count[e], count[e + 1]});
  auto out = torch::empty({N, s.D}, x.options());
  std::vector<float> y(M * s.D);
  pybind11::gil_scoped_release release;
  run_layer(s, reinterpret_cast<const uint16_t*>(x.data_ptr()), N, groups, token.data(), weight.data(), y.data(),
            reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

namespace {

// y = x W^T (bf16 out) for bf16 x [T, K] against the N rows of `p` in format `fmt` (bf16, or int8 with the inputs
// quantized first), 16 rows a task.
torch::Tensor gemv(int64_t fmt, const Projection& p, const torch::Tensor& x) {
  auto xc = x.contiguous();
  const int64_t T = xc.size(0), K = xc.size(1), N = p.N;
  auto yf = torch::empty({T, N}, x.options().dtype(torch::kFloat));
  auto out = torch::empty({T, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  float* yp = yf.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  pybind11::gil_scoped_release release;
  std::vector<const uint16_t*> xs(T);
  std::vector<QRow> xr(T);
  QBuffer xq;
  if (fmt == BF16) {
    for (int64_t t = 0; t < T; ++t) xs[t] = xp + t * K;
  } else {
    quantize_inputs(xp, T, K, fmt, xq);
    for (int64_t t = 0; t < T; ++t) xr[t] = xq.row(t);
  }
  at::parallel_for(0, (N + 15) / 16, grain_for((N + 15) / 16, T * N * K), [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task) {
      const int64_t r0 = task * 16, r1 = std::min(N, r0 + 16);
      rows_any(fmt, p, 0, r0, r1, fmt == BF16 ? xs.data() : nullptr, fmt == BF16 ? nullptr : xr.data(), T, yp, N);
      for (int64_t t = 0; t < T; ++t) to_bf16(yp + t * N + r0, op + t * N + r0, r1 - r0);
    }
  });
  return out;
}

}  // namespace

// y = x W^T for bf16 x [T, K] and W [N, K] (dense projections on a few tokens).
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.dim() == 2 &&
              w.dim() == 2 && x.size(1) == w.size(1) && w.is_contiguous(), "bf16 x [T, K] and contiguous W [N, K]");
  return gemv(BF16, {static_cast<const uint8_t*>(w.data_ptr()), nullptr, w.size(0), w.size(1)}, x);
}

// y = x (q * scale)^T for bf16 x [T, K], int8 q [N, K] and bf16 scales [N], the activations quantized to 8 bits in
// blocks of 32 (the int8 experts' arithmetic): `--dense-dtype int8-a8` projections.
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && q.scalar_type() == torch::kChar && q.is_contiguous() &&
              scale.scalar_type() == torch::kBFloat16 && scale.is_contiguous() && x.dim() == 2 && q.dim() == 2 &&
              x.size(1) == q.size(1) && scale.numel() == q.size(0), "bf16 x [T, K], int8 q [N, K], bf16 scale [N]");
  return gemv(INT8, {static_cast<const uint8_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(scale.data_ptr()),
                     q.size(0), q.size(1)}, x);
}

// Reads every byte of `x` once with 512-bit loads, threads splitting it: the machine's streaming read bandwidth, the
// limit the kernels above are measured against (benchmarks/cpu_kernels.py).
int64_t stream_read(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.nbytes() % 64 == 0, "a contiguous tensor of a multiple of 64 bytes");
  const auto* p = static_cast<const uint8_t*>(x.data_ptr());
  const int64_t chunks = x.nbytes() / 64, per = 1 << 14;
  std::vector<int64_t> part((chunks + per - 1) / per, 0);
  pybind11::gil_scoped_release release;
  at::parallel_for(0, static_cast<int64_t>(part.size()), 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
      const int64_t c0 = i * per, c1 = std::min(chunks, c0 + per);
      int64_t c = c0;
      for (; c + 4 <= c1; c += 4) {
        s0 = _mm512_add_epi64(s0, _mm512_loadu_si512(p + c * 64));
        s1 = _mm512_add_epi64(s1, _mm512_loadu_si512(p + c * 64 + 64));
        s2 = _mm512_add_epi64(s2, _mm512_loadu_si512(p + c * 64 + 128));
        s3 = _mm512_add_epi64(s3, _mm512_loadu_si512(p + c * 64 + 192));
      }
      for (; c < c1; ++c) s0 = _mm512_add_epi64(s0, _mm512_loadu_si512(p + c * 64));
      part[i] = _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
    }
  });
  int64_t total = 0;
  for (int64_t v : part) total += v;
  return total;
}

void register_step(pybind11::module_& m);  // cpu_step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_step(m);
  m.def("stream_read", &stream_read);
  m.def("moe_partial", &moe_partial);
  m.def("moe_combine", &moe_combine);
  m.def("moe_resident", &moe_resident);
  m.def("linear_bf16", &linear_bf16);
  m.def("linear_int8", &linear_int8);
}
