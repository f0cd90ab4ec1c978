// The avx512-bf16 tier of simd.h: AVX-512 F/BW/VL/DQ with AVX512-BF16 (vdpbf16ps: bf16 pairs into fp32) and
// AVX512-VNNI (vpdpbusd: u8 x s8 quads into int32). One __m512 is all 16 lanes; tails are masked loads and stores.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace {

constexpr const char* TIER = "avx512-bf16";

inline __mmask16 lane_mask(int64_t n) { return n >= 16 ? __mmask16(0xffff) : n <= 0 ? 0 : __mmask16((1u << n) - 1); }

struct F16 {
  __m512 v;
};
inline F16 fzero() { return {_mm512_setzero_ps()}; }
inline F16 fset1(float a) { return {_mm512_set1_ps(a)}; }
inline F16 fload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F16 fload(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(lane_mask(n), p)}; }
inline void fstore(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
inline void fstore(float* p, F16 a, int64_t n) { _mm512_mask_storeu_ps(p, lane_mask(n), a.v); }
inline F16 widen(__m256i h) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))}; }
inline F16 fload_bf16(const uint16_t* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline F16 fload_bf16(const uint16_t* p, int64_t n) { return widen(_mm256_maskz_loadu_epi16(lane_mask(n), p)); }
inline void fstore_bf16(uint16_t* p, F16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(a.v));
}
inline void fstore_bf16(uint16_t* p, F16 a, int64_t n) {
  _mm256_mask_storeu_epi16(p, lane_mask(n), (__m256i)_mm512_cvtneps_pbh(a.v));
}
inline F16 fround_bf16(F16 a) { return widen((__m256i)_mm512_cvtneps_pbh(a.v)); }
inline F16 operator+(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 operator-(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 operator/(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F16 ffma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16 ffnma(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline F16 fmax(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 fmin(F16 a, F16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F16 fround_int(F16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline F16 fscale2(F16 p, F16 n) { return {_mm512_scalef_ps(p.v, n.v)}; }
inline __m256 high256(F16 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)); }
inline float fsum(F16 a) {  // lanes i and i + 8, then i + 4, i + 2, i + 1
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(a.v), high256(a));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}
inline float fmaxall(F16 a) {
  const __m256 t8 = _mm256_max_ps(_mm512_castps512_ps256(a.v), high256(a));
  const __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_max_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}
inline bool fnonfinite(F16 a, int64_t n) {  // any of the first n lanes infinite or NaN
  const __m512i e = _mm512_set1_epi32(0x7f800000);
  return _mm512_mask_cmpeq_epi32_mask(lane_mask(n), _mm512_and_si512(_mm512_castps_si512(a.v), e), e) != 0;
}
inline int ffind(F16 a, float target, int64_t n) {  // the first of the first n lanes equal to target, or -1
  const __mmask16 hit = _mm512_mask_cmpeq_ps_mask(lane_mask(n), a.v, _mm512_set1_ps(target));
  return hit ? __builtin_ctz(hit) : -1;
}

struct B32 {
  __m512i v;
};
inline B32 bload(const uint16_t* p) { return {_mm512_loadu_si512(p)}; }
inline B32 bload(const uint16_t* p, int64_t n) {
  return {_mm512_maskz_loadu_epi16(n >= 32 ? ~__mmask32(0) : __mmask32((1ull << n) - 1), p)};
}
inline F16 bdot(F16 acc, B32 w, B32 x) { return {_mm512_dpbf16_ps(acc.v, (__m512bh)w.v, (__m512bh)x.v)}; }

// int8: |w| as u8 (128 for -128) times x with w's sign (x in [-127, 127]), four products a lane.
struct I8W {
  __m512i abs;
  __mmask64 neg;
};
inline I8W i8w(__m512i w) { return {_mm512_abs_epi8(w), _mm512_movepi8_mask(w)}; }
inline I8W i8load(const int8_t* p) { return i8w(_mm512_loadu_si512(p)); }
inline I8W i8load(const int8_t* p, int64_t n) {
  return i8w(_mm512_maskz_loadu_epi8(n >= 64 ? ~__mmask64(0) : __mmask64((1ull << n) - 1), p));
}
inline F16 i8dot(F16 acc, const I8W& w, const int8_t* x, const float* scale) {
  const __m512i zero = _mm512_setzero_si512(), xv = _mm512_loadu_si512(x);
  const __m512i d = _mm512_dpbusd_epi32(zero, w.abs, _mm512_mask_sub_epi8(xv, w.neg, zero, xv));
  return {_mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(scale), acc.v)};
}

// int4: a chunk's 64 bytes of nibbles, block j (32 inputs) in bytes 16j..16j+15, low nibbles its even inputs.
struct I4W {
  __m512i lo, hi;
};
inline I4W i4w(__m512i w) {
  const __m512i m = _mm512_set1_epi8(0x0F);
  return {_mm512_and_si512(w, m), _mm512_and_si512(_mm512_srli_epi16(w, 4), m)};
}
inline I4W i4load(const uint8_t* p) { return i4w(_mm512_loadu_si512(p)); }
inline I4W i4load(const uint8_t* p, int64_t n) {
  return i4w(_mm512_maskz_loadu_epi8(n >= 64 ? ~__mmask64(0) : __mmask64((1ull << n) - 1), p));
}
// A chunk's weight scales: lane i takes scale (i / 4) * 32 / group of the `count` at s (bf16), lanes past them 0.
struct I4Scales {
  __m512i index;
  explicit I4Scales(int64_t group) {
    alignas(64) int16_t idx[32] = {0};
    for (int i = 0; i < 16; ++i) idx[2 * i + 1] = static_cast<int16_t>((i / 4) * 32 / group);
    index = _mm512_load_si512(idx);
  }
  F16 operator()(const uint16_t* s, int64_t count) const {
    const __m128i sc = _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << count) - 1), s);
    return {_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, index, _mm512_castsi128_si512(sc)))};
  }
};
// lane i += float(corr[i] + the nibbles' quad i dotted with x's) * (xscale[i] * wscale[i]); x: 64 bytes of the
// chunk's even inputs (block j's at 16j), then 64 of its odd ones.
inline F16 i4dot(F16 acc, const I4W& w, F16 wscale, const uint8_t* x, const int32_t* corr, const float* xscale) {
  __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr), w.lo, _mm512_loadu_si512(x));
  d = _mm512_dpbusd_epi32(d, w.hi, _mm512_loadu_si512(x + 64));
  return {_mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(_mm512_loadu_ps(xscale), wscale.v), acc.v)};
}

inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

}  // namespace
