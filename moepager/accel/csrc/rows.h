// Weight rows of moepager's CPU kernels (experts.h, step.h): the expert formats, the activations quantized for the
// integer ones, and the dot products of a block of weight rows with a few inputs, written once over simd.h.
//
// Formats of one expert's flat buffer (experts/weights.py, experts/quant.py), byte offsets given by the caller:
// - bf16: gate_up [2F, D] then down [D, F], bf16. Dot products of bf16 pairs into fp32 (B32 bdot).
// - int8: q gate_up [2F, D] int8, q down [D, F] int8, one bf16 scale per output row. The activations are
//   quantized to int8 in blocks of 32 with one fp32 scale each (llama.cpp's Q8_0 activations) and dotted four
//   products at a time into int32 (I8W i8dot; weights in [-128, 127], activations in [-127, 127]).
// - int4, the "rows" layout (experts/quant.py): plain nibbles (low nibble = even input index; a GGUF Q4_0 block is the
//   same bytes up to the order of nibbles within the block), [N, K/2] per projection, symmetric groups of g (32, 64
//   or 128) with one bf16 scale per group, row-major [N, K/g]: w = (q - 8) * s. The activations are
//   quantized as for int8, split within each block into even and odd inputs (the nibbles' order), and dotted
//   with the nibbles as u8 (I4W i4dot; the -8 folded in as -8 * sum(x) per block).
//
// Every output element is one dot product accumulated in 16 fp32 lanes over the input in order, then summed across
// lanes (fsum), whatever the thread that computes it and whatever the tier.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace {

// A bad argument from the caller (the torch binding turns it into a Python error).
inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

enum Format : int64_t { BF16 = 0, INT8 = 1, INT4 = 2 };

// An expert format (the torch bindings read it field by field, by name, from accel/cpu_kernels.py's `FormatSpec`:
// csrc/bind.h `spec_of`).
struct Spec {
  int64_t fmt, D, F, group;                  // Format, hidden and intermediate sizes, int4 group (else 0)
  int64_t off_gu, off_dn, off_sgu, off_sdn;  // bytes from the start of an expert's buffer: weights, then scales
};

inline Spec checked(const Spec& p) {
  require(p.fmt >= 0 && p.fmt <= 2, "unknown expert format " + std::to_string(p.fmt));
  require(p.D > 0 && p.F > 0, "spec: D and F must be positive");
  if (p.fmt == INT4)
    require((p.group == 32 || p.group == 64 || p.group == 128) && p.D % p.group == 0 && p.F % p.group == 0,
            "int4 groups must be 32, 64 or 128 and divide D and F");
  return p;
}

// ---- activations quantized for the integer formats ------------------------------------------------------------
// Per chunk (64 inputs for int8, 128 for int4): the inputs as s8 (int4: block j's even inputs at bytes 16j.., its odd
// ones at 64 + 16j..), 16 int32 lanes of the -8 * sum(x) correction (int4) and 16 fp32 lanes of block scales (int8:
// [block 0] x 8, [block 1] x 8; int4: [block j] x 4 at lanes 4j..). Inputs past K are zero.
struct QRow {
  int8_t* q;
  int32_t* corr;
  float* scale;
};

inline int64_t chunk_inputs(int64_t fmt) { return fmt == INT4 ? 128 : 64; }

struct QBuffer {
  int64_t chunks = 0, width = 64;
  std::vector<int8_t> q;
  std::vector<int32_t> corr;
  std::vector<float> scale;
  void resize(int64_t rows, int64_t k, int64_t fmt) {
    width = chunk_inputs(fmt);
    chunks = (k + width - 1) / width;
    q.assign(rows * chunks * width, 0);
    corr.assign(rows * chunks * 16, 0);
    scale.assign(rows * chunks * 16, 0.f);
  }
  QRow row(int64_t r) { return {q.data() + r * chunks * width, corr.data() + r * chunks * 16,
                                scale.data() + r * chunks * 16}; }
};

// Quantize one chunk (n valid inputs of src: up to 64 for int8, 128 for int4) into chunk c of `out`, in blocks of 32
// with one scale each (scalar code, the same in every tier).
inline void quantize_chunk(const float* src, int64_t n, int64_t fmt, QRow out, int64_t c) {
  const int64_t blocks = chunk_inputs(fmt) / 32, lanes = 16 / blocks;
  int8_t* q = out.q + c * chunk_inputs(fmt);
  int32_t* corr = out.corr + c * 16;
  float* sc = out.scale + c * 16;
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
      for (int i = 0; i < 32; ++i) q[lo + i] = v[i];
    } else {
      for (int i = 0; i < 16; ++i) {
        q[16 * b + i] = v[2 * i];
        q[64 + 16 * b + i] = v[2 * i + 1];
      }
      corr[b * lanes] = -8 * sum;
    }
  }
}

inline void quantize_row(const float* src, int64_t k, int64_t fmt, QRow out) {
  const int64_t w = chunk_inputs(fmt);
  for (int64_t c = 0; c * w < k; ++c) quantize_chunk(src + c * w, std::min<int64_t>(w, k - c * w), fmt, out, c);
}

// ---- bf16 rows, vectorized ------------------------------------------------------------------------------------

// out[i] = bf16(src[i]) for i in [0, n).
inline void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) fstore_bf16(dst + i, fload(src + i, n - i), n - i);
}

// out[i] = bf16(a[i] + b[i]) for i in [0, n): torch's bf16 add (the sum in fp32, rounded once). out may be a or b.
inline void add_bf16_row(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) fstore_bf16(out + i, fload_bf16(a + i, n - i) + fload_bf16(b + i, n - i), n - i);
}

// ---- dot products of R weight rows with T inputs: out[t][r] --------------------------------------------------

// Every weight row is read with a software prefetch into L2 this far ahead (rows lie one after another, so this is one
// linear stream per matrix): it raised the read rate of a qwen3-30b-a3b layer's experts from RAM in every format and
// left the LM head at the stream rate; into L1 a few KiB ahead was worse than none (docs/history/2026-12.md).
constexpr int64_t PREFETCH = 8192;

// R adjacent bf16 weight rows (row i at w + i K) against T inputs: out[i T + t], two independent accumulators per row
// and input, each taking the same operations in the same order whatever R and T (so the same bits). R = 2 with one
// input (rows_any) overlaps two rows' chains of fused multiply-adds and shares the input's loads (on AVX2 also its
// shifts and masks). Rows of one input's bf16 projection taken at once: four with AVX-512's 32 registers (a large
// matrix's loads then stream from more places at once); two elsewhere (four rows' accumulators would take all 16 AVX2
// registers). Both choices were measured in ad-hoc probes (docs/history/2026-12.md).
#if defined(__AVX512F__)
constexpr int BF16_ROWS = 4;
#else
constexpr int BF16_ROWS = 2;
#endif

template <int R, int T>
inline void dot_bf16_rows(const uint16_t* w, const uint16_t* const* x, int64_t K, float* out) {
  F16 a0[R][T], a1[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) a0[i][t] = a1[i][t] = fzero();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    for (int i = 0; i < R; ++i) prefetch_l2(reinterpret_cast<const char*>(w + i * K + k) + PREFETCH);
    for (int i = 0; i < R; ++i) {  // (the inputs' loads are the same for every row: the compiler shares them)
      const B32 w0 = bload(w + i * K + k), w1 = bload(w + i * K + k + 32);
      for (int t = 0; t < T; ++t) {
        a0[i][t] = bdot(a0[i][t], w0, bload(x[t] + k));
        a1[i][t] = bdot(a1[i][t], w1, bload(x[t] + k + 32));
      }
    }
  }
  for (; k < K; k += 32)
    for (int i = 0; i < R; ++i) {
      const B32 wv = bload(w + i * K + k, K - k);
      for (int t = 0; t < T; ++t) a0[i][t] = bdot(a0[i][t], wv, bload(x[t] + k, K - k));
    }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) out[i * T + t] = fsum(a0[i][t] + a1[i][t]);
}

// One bf16 weight row (K inputs) against T inputs.
template <int T>
inline void dot_bf16(const uint16_t* w, const uint16_t* const* x, int64_t K, float* out) {
  dot_bf16_rows<1, T>(w, x, K, out);
}

template <int T>
inline void dot_int8(const int8_t* w, const QRow* x, int64_t K, float* out) {
  F16 a0[T], a1[T];
  for (int t = 0; t < T; ++t) a0[t] = a1[t] = fzero();
  int64_t c = 0;
  for (; (c + 2) * 64 <= K; c += 2) {
    prefetch_l2(w + c * 64 + PREFETCH);
    const I8W w0 = i8load(w + c * 64), w1 = i8load(w + c * 64 + 64);
    for (int t = 0; t < T; ++t) {
      a0[t] = i8dot(a0[t], w0, x[t].q + c * 64, x[t].scale + c * 16);
      a1[t] = i8dot(a1[t], w1, x[t].q + (c + 1) * 64, x[t].scale + (c + 1) * 16);
    }
  }
  for (; c * 64 < K; ++c) {
    const I8W wv = i8load(w + c * 64, K - c * 64);
    for (int t = 0; t < T; ++t) a0[t] = i8dot(a0[t], wv, x[t].q + c * 64, x[t].scale + c * 16);
  }
  for (int t = 0; t < T; ++t) out[t] = fsum(a0[t] + a1[t]);
}

// int4 ("rows" layout): w points at the row's K/2 bytes of plain nibbles, s at its K/g bf16 group scales. A chunk is
// 128 inputs: 64 bytes of nibbles, four blocks of 32 (block j at bytes 16j..16j+15, low nibbles its even inputs),
// dotted against the activations' evens and odds laid out the same way (QBuffer for INT4). A group (32, 64 or 128:
// parse_spec) divides a chunk, so chunk c's scales are the 128 / g from c * 128 / g on.
template <int T>
inline void dot_int4(const uint8_t* w, const uint16_t* s, int64_t group, const QRow* x, int64_t K, float* out,
                     const I4Scales& scales) {
  F16 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = fzero();
  const int64_t per = 128 / group, full = K / 128;  // scales a chunk, whole chunks
  for (int64_t c = 0; c < full; ++c) {
    prefetch_l2(w + c * 64 + PREFETCH);
    const I4W wv = i4load(w + c * 64);
    const F16 sv = scales(s + c * per, per);
    for (int t = 0; t < T; ++t)
      acc[t] = i4dot(acc[t], wv, sv, reinterpret_cast<const uint8_t*>(x[t].q) + c * 128, x[t].corr + c * 16,
                     x[t].scale + c * 16);
  }
  if (const int64_t left = K - full * 128; left > 0) {  // a multiple of the group: its groups only
    const I4W wv = i4load(w + full * 64, left / 2);
    const F16 sv = scales(s + full * per, left / group);
    for (int t = 0; t < T; ++t)
      acc[t] = i4dot(acc[t], wv, sv, reinterpret_cast<const uint8_t*>(x[t].q) + full * 128, x[t].corr + full * 16,
                     x[t].scale + full * 16);
  }
  for (int t = 0; t < T; ++t) out[t] = fsum(acc[t]);
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
                    const QRow* xq, float* out, const I4Scales& scales) {
  if (fmt == BF16) {
    dot_bf16<T>(reinterpret_cast<const uint16_t*>(p.w) + r * p.K, xb, p.K, out);
  } else if (fmt == INT8) {
    dot_int8<T>(reinterpret_cast<const int8_t*>(p.w) + r * p.K, xq, p.K, out);
    const float sc = bf16_to_float(p.scale[r]);
    for (int t = 0; t < T; ++t) out[t] *= sc;
  } else {
    dot_int4<T>(p.w + r * (p.K / 2), p.scale + r * (p.K / group), group, xq, p.K, out, scales);
  }
}

inline void rows_any(int64_t fmt, const Projection& p, int64_t group, int64_t r0, int64_t r1,
                     const uint16_t* const* xb, const QRow* xq, int64_t n, float* y, int64_t ldy) {
  const I4Scales scales(fmt == INT4 ? group : 32);
  float tmp[4];
  for (int64_t t = 0; t < n; t += 4) {
    const int64_t c = std::min<int64_t>(4, n - t);
    const uint16_t* const* xbt = xb ? xb + t : nullptr;
    const QRow* xqt = xq ? xq + t : nullptr;
    int64_t r = r0;
    if (fmt == BF16 && c == 1) {  // one input: rows BF16_ROWS (then two) at a time, the same bits as one at a time
      for (; BF16_ROWS > 2 && r + BF16_ROWS <= r1; r += BF16_ROWS)
        dot_bf16_rows<BF16_ROWS, 1>(reinterpret_cast<const uint16_t*>(p.w) + r * p.K, xbt, p.K, y + t * ldy + r);
      for (; r + 2 <= r1; r += 2)
        dot_bf16_rows<2, 1>(reinterpret_cast<const uint16_t*>(p.w) + r * p.K, xbt, p.K, y + t * ldy + r);
    }
    for (; r < r1; ++r) {
      switch (c) {
        case 4: row_dot<4>(fmt, p, group, r, xbt, xqt, tmp, scales); break;
        case 3: row_dot<3>(fmt, p, group, r, xbt, xqt, tmp, scales); break;
        case 2: row_dot<2>(fmt, p, group, r, xbt, xqt, tmp, scales); break;
        default: row_dot<1>(fmt, p, group, r, xbt, xqt, tmp, scales); break;
      }
      for (int64_t i = 0; i < c; ++i) y[(t + i) * ldy + r] = tmp[i];
    }
  }
}

// ---- SiLU(gate) * up, vectorized ------------------------------------------------------------------------------

inline void swiglu(const float* g, const float* u, float* h, int64_t n) {
  const F16 one = fset1(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const F16 gv = fload(g + i, n - i);
    const F16 s = gv / (one + fexp(fzero() - gv));
    fstore(h + i, s * fload(u + i, n - i), n - i);
  }
}

// Rows r0..r1 of y = x W^T for T inputs (bf16 rows xb, or quantized rows xq) against the N rows of `p`: fp32 into
// y [T, N], rounded to bf16 into out [T, N] (the dense GEMV's task).
inline void gemv_rows(int64_t fmt, const Projection& p, const uint16_t* const* xb, const QRow* xq, int64_t T,
                      int64_t r0, int64_t r1, float* y, uint16_t* out) {
  rows_any(fmt, p, 0, r0, r1, xb, xq, T, y, p.N);
  for (int64_t t = 0; t < T; ++t) to_bf16(y + t * p.N + r0, out + t * p.N + r0, r1 - r0);
}

// y = x W^T (bf16 out [T, N], fp32 scratch y [T, N]) for T inputs against every row of `p`, 16 rows a task shared
// among the kernel threads (bf16 inputs xb, or quantized xq): linear_bf16's and the whole decode step's LM head.
inline void gemv_all(int64_t fmt, const Projection& p, const uint16_t* const* xb, const QRow* xq, int64_t T, float* y,
                     uint16_t* out) {
  const int64_t tasks = (p.N + 15) / 16;
  parallel_for(0, tasks, grain_for(tasks, T * p.N * p.K), [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task)
      gemv_rows(fmt, p, xb, xq, T, task * 16, std::min(p.N, task * 16 + 16), y, out);
  });
}

}  // namespace
