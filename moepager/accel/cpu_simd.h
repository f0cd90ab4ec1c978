// Helpers shared by moepager's CPU kernels (cpu_moe.cpp: the MoE layer and the dense GEMV; cpu_step.cpp: the rest
// of a decode step): bf16 <-> fp32 with AVX-512 and scalars, masked tails, and a vectorized e^x.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// A call of fewer multiply-adds than this runs on the calling thread alone: waking the pool costs more than a second
// core saves on weights that sit in the caches (this project's Zen 5, one token, bf16 GEMV, 1 / 2 threads: 512x256
// 6.9 / 7.7 us, 1024x256 13.1 / 12.9, 2048x256 24.5 / 26.7, 4096x256 46.2 / 44.2, 8192x256 94 / 71).
constexpr int64_t SERIAL_MACS = 1 << 19;

// at::parallel_for's grain for `tasks` tasks of `macs` multiply-adds in all: every task inline below SERIAL_MACS.
inline int64_t grain_for(int64_t tasks, int64_t macs) { return macs < SERIAL_MACS ? tasks + 1 : 1; }

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// fp32 -> bf16 rounded to nearest even, NaN kept a (quiet) NaN: the rounding of torch's bf16 tensors (c10::BFloat16).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

inline __m512i load_tail_bf16(const uint16_t* p, int64_t n) {  // n in 1..32 elements
  return n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
}

inline __mmask16 tail_mask(int64_t n) {  // the first min(n, 16) lanes
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}

inline __m512 load_bf16x16(const uint16_t* p, __mmask16 m) {  // up to 16 bf16 as fp32 (lanes off the mask: 0)
  const __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m512 round_bf16x16(__m512 v) {  // fp32 lanes rounded to bf16 (nearest even) and back
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Every weight row is read with a software prefetch into L2 this far ahead (rows lie one after another, so this is one
// linear stream per matrix). Ad-hoc probe, 2026-11-28, interleaved rounds, one qwen3-30b-a3b MoE layer's 8 experts from
// RAM at 1 / 2 threads, GB/s of weights: bf16 23.7-26.0 / 27.8-30.1 with it, 18.4-22.0 / 26.0-28.2 without; int8
// 13.1-19.7 / 20.1-27.8 and 11.8-17.5 / 20.2-27.6; int4 15.3-20.8 / 23.5-28.6 and 11.7-13.9 / 16.5-22.8. The 622 MB LM
// head at 1 thread: 25.5-26.8 with, 24.6-26.3 without (stream 26.4-27.9). Into L1 4 KiB ahead was worse than none
// for bf16 (17.2-17.9 on the LM head).
constexpr int64_t PREFETCH = 8192;

inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// One weight row (K inputs) against T inputs, two independent accumulators per input.
template <int T>
inline void dot_bf16(const uint16_t* w, const uint16_t* const* x, int64_t K, float* out) {
  __m512 a0[T], a1[T];
  for (int t = 0; t < T; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    prefetch_l2(reinterpret_cast<const char*>(w + k) + PREFETCH);
    const __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 32);
    for (int t = 0; t < T; ++t) {
      a0[t] = _mm512_dpbf16_ps(a0[t], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(x[t] + k));
      a1[t] = _mm512_dpbf16_ps(a1[t], (__m512bh)w1, (__m512bh)_mm512_loadu_si512(x[t] + k + 32));
    }
  }
  for (; k < K; k += 32) {
    const __m512i wv = load_tail_bf16(w + k, K - k);
    for (int t = 0; t < T; ++t) a0[t] = _mm512_dpbf16_ps(a0[t], (__m512bh)wv, (__m512bh)load_tail_bf16(x[t] + k, K - k));
  }
  for (int t = 0; t < T; ++t) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}

// out[i] = bf16(a[i] + b[i]) for i in [0, n): torch's bf16 add (the sum in fp32, rounded once). out may be a or b.
inline void add_bf16_row(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = _mm512_add_ps(load_bf16x16(a + i, m), load_bf16x16(b + i, m));
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

inline __m512 exp512(__m512 x) {  // e^x for x in [-88, 88]: 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2]
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i)));
  }
}

}  // namespace
