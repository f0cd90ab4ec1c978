// The avx2 tier of simd.h: AVX2, FMA and F16C (x86-64-v3: Intel since Haswell, AMD since Zen 1). 16 lanes are two
// __m256. bf16 becomes fp32 by a shift (even elements) or a mask (odd ones); vdpbf16ps's pairs are two fused
// multiply-adds in its order. int8 and int4 quads are vpmaddubsw (u8 x s8 pairs into int16, which these operands
// cannot saturate: |w| <= 128 and |x| <= 127, or nibbles <= 15) then vpmaddwd by ones (pairs of pairs into int32),
// as llama.cpp's AVX2 Q8_0 and Q4_0 dot products. Tails go through a zeroed buffer (AVX2 has no byte masks).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr const char* TIER = "avx2";

struct F16 {
  __m256 lo, hi;  // lanes 0..7, 8..15
};
inline F16 fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 fset1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline F16 fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F16 fload(const float* p, int64_t n) {
  if (n >= 16) return fload(p);
  alignas(32) float t[16] = {0};
  if (n > 0) std::memcpy(t, p, n * sizeof(float));
  return fload(t);
}
inline void fstore(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void fstore(float* p, F16 a, int64_t n) {
  if (n >= 16) return fstore(p, a);
  alignas(32) float t[16];
  fstore(t, a);
  if (n > 0) std::memcpy(p, t, n * sizeof(float));
}
inline __m256 widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline F16 fload_bf16(const uint16_t* p) {
  return {widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline F16 fload_bf16(const uint16_t* p, int64_t n) {
  if (n >= 16) return fload_bf16(p);
  alignas(32) uint16_t t[16] = {0};
  if (n > 0) std::memcpy(t, p, n * sizeof(uint16_t));
  return fload_bf16(t);
}
// fp32 -> bf16 in the low 16 bits of each int32 lane, as vcvtneps2bf16: NaN quieted, subnormals to a signed zero,
// else rounded to nearest even.
inline __m256i bf16_bits(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i top = _mm256_srli_epi32(u, 16);
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(top, _mm256_set1_epi32(1)))),
      16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)), _mm256_setzero_si256());
  __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
  return _mm256_blendv_epi8(r, _mm256_and_si256(top, _mm256_set1_epi32(0x8000)), sub);
}
inline void fstore_bf16(uint16_t* p, F16 a) {  // packus works within 128-bit halves: the permute restores the order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(a.lo), bf16_bits(a.hi)), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}
inline void fstore_bf16(uint16_t* p, F16 a, int64_t n) {
  if (n >= 16) return fstore_bf16(p, a);
  alignas(32) uint16_t t[16];
  fstore_bf16(t, a);
  if (n > 0) std::memcpy(p, t, n * sizeof(uint16_t));
}
inline F16 fround_bf16(F16 a) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a.hi), 16))};
}
inline F16 operator+(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 operator-(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 operator/(F16 a, F16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F16 ffma(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 ffnma(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 fmax(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 fmin(F16 a, F16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline F16 fround_int(F16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// p * 2^n for integral n in [-127, 127], rounded once (as vscalefps): 2^(n >> 1) and 2^(n - (n >> 1)) are normal,
// and the first product is exact.
inline __m256 scale8(__m256 p, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(k, k1), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}
inline F16 fscale2(F16 p, F16 n) { return {scale8(p.lo, n.lo), scale8(p.hi, n.hi)}; }
inline float fsum(F16 a) {  // lanes i and i + 8, then i + 4, i + 2, i + 1
  const __m256 t8 = _mm256_add_ps(a.lo, a.hi);
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}
inline float fmaxall(F16 a) {
  const __m256 t8 = _mm256_max_ps(a.lo, a.hi);
  const __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_max_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}
inline unsigned first_lanes(int64_t n) { return n >= 16 ? 0xffffu : n <= 0 ? 0u : (1u << n) - 1; }
inline unsigned lane_bits(__m256 lo, __m256 hi) {
  return static_cast<unsigned>(_mm256_movemask_ps(lo)) | (static_cast<unsigned>(_mm256_movemask_ps(hi)) << 8);
}
inline bool fnonfinite(F16 a, int64_t n) {
  const __m256i e = _mm256_set1_epi32(0x7f800000);
  auto inf_or_nan = [&](__m256 v) {
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), e), e));
  };
  return (lane_bits(inf_or_nan(a.lo), inf_or_nan(a.hi)) & first_lanes(n)) != 0;
}
inline int ffind(F16 a, float target, int64_t n) {
  const __m256 t = _mm256_set1_ps(target);
  const unsigned hit = lane_bits(_mm256_cmp_ps(a.lo, t, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, t, _CMP_EQ_OQ)) &
                       first_lanes(n);
  return hit ? __builtin_ctz(hit) : -1;
}

struct B32 {
  __m256i lo, hi;  // bf16 0..15, 16..31
};
inline B32 bload(const uint16_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
}
inline B32 bload(const uint16_t* p, int64_t n) {
  if (n >= 32) return bload(p);
  alignas(32) uint16_t t[32] = {0};
  if (n > 0) std::memcpy(t, p, n * sizeof(uint16_t));
  return bload(t);
}
inline __m256 pair_dot(__m256 acc, __m256i w, __m256i x) {  // lane i: w[2i+1] x[2i+1], then w[2i] x[2i]
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w, odd)), _mm256_castsi256_ps(_mm256_and_si256(x, odd)),
                        acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)),
                         acc);
}
inline F16 bdot(F16 acc, B32 w, B32 x) { return {pair_dot(acc.lo, w.lo, x.lo), pair_dot(acc.hi, w.hi, x.hi)}; }

// n bytes of p (64 or fewer), the rest 0. Whole halves load directly: a 32-byte tail (an int4 row of 64 inputs, the
// built-in model's down projection, on every row) through the zeroed buffer cost its int4 layer 30% on the Zen 3.
inline void load64(const void* p, int64_t n, __m256i& a, __m256i& b) {
  const uint8_t* q = static_cast<const uint8_t*>(p);
  auto part = [](const uint8_t* src, int64_t m) {  // m < 32 bytes
    alignas(32) uint8_t t[32] = {0};
    if (m > 0) std::memcpy(t, src, m);
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
  };
  if (n >= 32) {
    a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    b = n >= 64 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32))
        : n == 32 ? _mm256_setzero_si256() : part(q + 32, n - 32);
  } else {
    a = part(q, n);
    b = _mm256_setzero_si256();
  }
}

// int8: vpmaddubsw(|w|, x with w's sign) into int16 pairs, vpmaddwd(., 1) into int32 quads.
struct I8W {
  __m256i w[2], abs[2];
};
inline I8W i8load(const int8_t* p, int64_t n = 64) {
  I8W r;
  load64(p, n, r.w[0], r.w[1]);
  r.abs[0] = _mm256_abs_epi8(r.w[0]);
  r.abs[1] = _mm256_abs_epi8(r.w[1]);
  return r;
}
inline F16 i8dot(F16 acc, const I8W& w, const int8_t* x, const float* scale) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[2] = {acc.lo, acc.hi};
  for (int h = 0; h < 2; ++h) {
    const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * h)), w.w[h]);
    const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(w.abs[h], xs), ones);
    out[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(scale + 8 * h), out[h]);
  }
  return {out[0], out[1]};
}

struct I4W {
  __m256i lo[2], hi[2];
};
inline I4W i4load(const uint8_t* p, int64_t n = 64) {
  I4W r;
  __m256i w[2];
  load64(p, n, w[0], w[1]);
  const __m256i m = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    r.lo[h] = _mm256_and_si256(w[h], m);
    r.hi[h] = _mm256_and_si256(_mm256_srli_epi16(w[h], 4), m);
  }
  return r;
}
struct I4Scales {
  int64_t index[4];  // block j's scale among the chunk's (j * 32 / group), found once
  explicit I4Scales(int64_t g) {
    for (int j = 0; j < 4; ++j) index[j] = j * 32 / g;
  }
  F16 operator()(const uint16_t* s, int64_t count) const {
    float b[4];
    for (int j = 0; j < 4; ++j) b[j] = index[j] < count ? bf16_to_float(s[index[j]]) : 0.f;
    return {_mm256_setr_m128(_mm_set1_ps(b[0]), _mm_set1_ps(b[1])), _mm256_setr_m128(_mm_set1_ps(b[2]),
                                                                                      _mm_set1_ps(b[3]))};
  }
};
inline F16 i4dot(F16 acc, const I4W& w, F16 wscale, const uint8_t* x, const int32_t* corr, const float* xscale) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[2] = {acc.lo, acc.hi};
  const __m256 ws[2] = {wscale.lo, wscale.hi};
  for (int h = 0; h < 2; ++h) {
    const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * h));
    const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64 + 32 * h));
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w.lo[h], xe), _mm256_maddubs_epi16(w.hi[h], xo));
    const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + 8 * h)));
    out[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(_mm256_loadu_ps(xscale + 8 * h), ws[h]), out[h]);
  }
  return {out[0], out[1]};
}

inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

}  // namespace
