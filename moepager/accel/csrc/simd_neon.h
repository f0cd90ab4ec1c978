// The neon tier of simd.h: ARM64 Advanced SIMD (every ARMv8-A core: Apple Silicon, Graviton, Ampere, Cortex-A).
// 16 lanes are four float32x4_t. bf16 becomes fp32 by a shift (even elements) or a mask (odd ones), vdpbf16ps's
// pairs two fused multiply-adds in its order; ARMv8.6's BFDOT is not used, for its products are not IEEE steps.
// int8 and int4 quads are SDOT (s8 x s8 into int32) where built with the dot-product extension
// (__ARM_FEATURE_DOTPROD, the neon-dotprod build), else widening multiplies and pairwise adds. min and max are x86's
// (a > b ? a : b), not NEON's NaN-propagating ones, so every tier clamps alike.
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include <cstring>

namespace {

#if defined(__ARM_FEATURE_DOTPROD)
constexpr const char* TIER = "neon-dotprod";
#else
constexpr const char* TIER = "neon";
#endif

struct F16 {
  float32x4_t q[4];
};
template <class Op>
inline F16 fmap4(Op op) {
  return {{op(0), op(1), op(2), op(3)}};
}
inline F16 fzero() { return fmap4([](int) { return vdupq_n_f32(0.f); }); }
inline F16 fset1(float a) { return fmap4([a](int) { return vdupq_n_f32(a); }); }
inline F16 fload(const float* p) { return fmap4([p](int j) { return vld1q_f32(p + 4 * j); }); }
inline F16 fload(const float* p, int64_t n) {
  if (n >= 16) return fload(p);
  float t[16] = {0};
  if (n > 0) std::memcpy(t, p, n * sizeof(float));
  return fload(t);
}
inline void fstore(float* p, F16 a) {
  for (int j = 0; j < 4; ++j) vst1q_f32(p + 4 * j, a.q[j]);
}
inline void fstore(float* p, F16 a, int64_t n) {
  if (n >= 16) return fstore(p, a);
  float t[16];
  fstore(t, a);
  if (n > 0) std::memcpy(p, t, n * sizeof(float));
}
inline float32x4_t widen4(uint16x4_t h) { return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); }
inline F16 fload_bf16(const uint16_t* p) { return fmap4([p](int j) { return widen4(vld1_u16(p + 4 * j)); }); }
inline F16 fload_bf16(const uint16_t* p, int64_t n) {
  if (n >= 16) return fload_bf16(p);
  uint16_t t[16] = {0};
  if (n > 0) std::memcpy(t, p, n * sizeof(uint16_t));
  return fload_bf16(t);
}
inline uint32x4_t bf16_bits(float32x4_t a) {  // vcvtneps2bf16's rounding, the result in each lane's low 16 bits
  const uint32x4_t u = vreinterpretq_u32_f32(a);
  const uint32x4_t top = vshrq_n_u32(u, 16);
  const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), vandq_u32(top, vdupq_n_u32(1)))),
                                         16);
  const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
  const uint32x4_t sub = vceqq_u32(vandq_u32(u, vdupq_n_u32(0x7f800000)), vdupq_n_u32(0));
  const uint32x4_t r = vbslq_u32(nan, vorrq_u32(top, vdupq_n_u32(0x40)), rounded);
  return vbslq_u32(sub, vandq_u32(top, vdupq_n_u32(0x8000)), r);
}
inline void fstore_bf16(uint16_t* p, F16 a) {
  for (int j = 0; j < 4; ++j) vst1_u16(p + 4 * j, vmovn_u32(bf16_bits(a.q[j])));
}
inline void fstore_bf16(uint16_t* p, F16 a, int64_t n) {
  if (n >= 16) return fstore_bf16(p, a);
  uint16_t t[16];
  fstore_bf16(t, a);
  if (n > 0) std::memcpy(p, t, n * sizeof(uint16_t));
}
inline F16 fround_bf16(F16 a) {
  return fmap4([&](int j) { return vreinterpretq_f32_u32(vshlq_n_u32(bf16_bits(a.q[j]), 16)); });
}
inline F16 operator+(F16 a, F16 b) { return fmap4([&](int j) { return vaddq_f32(a.q[j], b.q[j]); }); }
inline F16 operator-(F16 a, F16 b) { return fmap4([&](int j) { return vsubq_f32(a.q[j], b.q[j]); }); }
inline F16 operator*(F16 a, F16 b) { return fmap4([&](int j) { return vmulq_f32(a.q[j], b.q[j]); }); }
inline F16 operator/(F16 a, F16 b) { return fmap4([&](int j) { return vdivq_f32(a.q[j], b.q[j]); }); }
inline F16 ffma(F16 a, F16 b, F16 c) { return fmap4([&](int j) { return vfmaq_f32(c.q[j], a.q[j], b.q[j]); }); }
inline F16 ffnma(F16 a, F16 b, F16 c) { return fmap4([&](int j) { return vfmsq_f32(c.q[j], a.q[j], b.q[j]); }); }
inline float32x4_t max4(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
inline F16 fmax(F16 a, F16 b) { return fmap4([&](int j) { return max4(a.q[j], b.q[j]); }); }
inline F16 fmin(F16 a, F16 b) { return fmap4([&](int j) { return vbslq_f32(vcltq_f32(a.q[j], b.q[j]), a.q[j], b.q[j]); }); }
inline F16 fround_int(F16 a) { return fmap4([&](int j) { return vrndnq_f32(a.q[j]); }); }
inline float32x4_t scale4(float32x4_t p, float32x4_t n) {  // as simd_avx2.h's scale8
  const int32x4_t k = vcvtq_s32_f32(n), k1 = vshrq_n_s32(k, 1), bias = vdupq_n_s32(127);
  const float32x4_t a = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k1, bias), 23));
  const float32x4_t b = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vsubq_s32(k, k1), bias), 23));
  return vmulq_f32(vmulq_f32(p, a), b);
}
inline F16 fscale2(F16 p, F16 n) { return fmap4([&](int j) { return scale4(p.q[j], n.q[j]); }); }
inline float fsum(F16 a) {  // lanes i and i + 8, then i + 4, i + 2, i + 1
  const float32x4_t t4 = vaddq_f32(vaddq_f32(a.q[0], a.q[2]), vaddq_f32(a.q[1], a.q[3]));
  const float32x2_t t2 = vadd_f32(vget_low_f32(t4), vget_high_f32(t4));
  return vget_lane_f32(t2, 0) + vget_lane_f32(t2, 1);
}
inline float fmaxall(F16 a) {
  const float32x4_t t4 = max4(max4(a.q[0], a.q[2]), max4(a.q[1], a.q[3]));
  const float a0 = vgetq_lane_f32(t4, 0), a1 = vgetq_lane_f32(t4, 1), a2 = vgetq_lane_f32(t4, 2),
              a3 = vgetq_lane_f32(t4, 3);
  const float b0 = a0 > a2 ? a0 : a2, b1 = a1 > a3 ? a1 : a3;
  return b0 > b1 ? b0 : b1;
}
inline bool fnonfinite(F16 a, int64_t n) {
  float t[16];
  fstore(t, a);
  for (int i = 0; i < 16 && i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, t + i, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return true;
  }
  return false;
}
inline int ffind(F16 a, float target, int64_t n) {
  float t[16];
  fstore(t, a);
  for (int i = 0; i < 16 && i < n; ++i)
    if (t[i] == target) return i;
  return -1;
}

struct B32 {
  uint32x4_t q[4];  // bf16 pairs: 8 bf16 (4 lanes) each
};
inline B32 bload(const uint16_t* p) {
  return {{vreinterpretq_u32_u16(vld1q_u16(p)), vreinterpretq_u32_u16(vld1q_u16(p + 8)),
           vreinterpretq_u32_u16(vld1q_u16(p + 16)), vreinterpretq_u32_u16(vld1q_u16(p + 24))}};
}
inline B32 bload(const uint16_t* p, int64_t n) {
  if (n >= 32) return bload(p);
  uint16_t t[32] = {0};
  if (n > 0) std::memcpy(t, p, n * sizeof(uint16_t));
  return bload(t);
}
inline F16 bdot(F16 acc, const B32& w, const B32& x) {
  const uint32x4_t odd = vdupq_n_u32(0xffff0000u);
  return fmap4([&](int j) {
    const float32x4_t a = vfmaq_f32(acc.q[j], vreinterpretq_f32_u32(vandq_u32(w.q[j], odd)),
                                    vreinterpretq_f32_u32(vandq_u32(x.q[j], odd)));
    return vfmaq_f32(a, vreinterpretq_f32_u32(vshlq_n_u32(w.q[j], 16)), vreinterpretq_f32_u32(vshlq_n_u32(x.q[j], 16)));
  });
}

// n bytes of p (64 or fewer), the rest 0: whole 16-byte quarters load directly, only a partial one goes through a
// zeroed buffer (as the avx2 tier's halves: a 32-byte int4 row of 64 inputs, the built-in model's down projection,
// went through the buffer whole on every row).
inline void load64(const void* p, int64_t n, uint8x16_t* q) {
  const uint8_t* src = static_cast<const uint8_t*>(p);
  for (int j = 0; j < 4; ++j) {
    const int64_t m = n - 16 * j;
    if (m >= 16) {
      q[j] = vld1q_u8(src + 16 * j);
    } else if (m <= 0) {
      q[j] = vdupq_n_u8(0);
    } else {
      uint8_t t[16] = {0};
      std::memcpy(t, src + 16 * j, m);
      q[j] = vld1q_u8(t);
    }
  }
}
inline int32x4_t quads(int8x16_t a, int8x16_t b, int32x4_t acc) {  // acc lane i + the dot of bytes 4i..4i+3
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b)), hi = vmull_s8(vget_high_s8(a), vget_high_s8(b));
  return vaddq_s32(acc, vpaddlq_s16(vpaddq_s16(lo, hi)));  // |pair| <= 2 * 128 * 127: int16 holds it
#endif
}

struct I8W {
  int8x16_t q[4];
};
inline I8W i8load(const int8_t* p, int64_t n = 64) {
  uint8x16_t b[4];
  load64(p, n, b);
  return {{vreinterpretq_s8_u8(b[0]), vreinterpretq_s8_u8(b[1]), vreinterpretq_s8_u8(b[2]), vreinterpretq_s8_u8(b[3])}};
}
inline F16 i8dot(F16 acc, const I8W& w, const int8_t* x, const float* scale) {
  return fmap4([&](int j) {
    const int32x4_t d = quads(w.q[j], vld1q_s8(x + 16 * j), vdupq_n_s32(0));
    return vfmaq_f32(acc.q[j], vcvtq_f32_s32(d), vld1q_f32(scale + 4 * j));
  });
}

struct I4W {
  int8x16_t lo[4], hi[4];  // nibbles 0..15 as s8
};
inline I4W i4load(const uint8_t* p, int64_t n = 64) {
  uint8x16_t b[4];
  load64(p, n, b);
  I4W r;
  for (int j = 0; j < 4; ++j) {
    r.lo[j] = vreinterpretq_s8_u8(vandq_u8(b[j], vdupq_n_u8(0x0F)));
    r.hi[j] = vreinterpretq_s8_u8(vshrq_n_u8(b[j], 4));
  }
  return r;
}
struct I4Scales {
  int64_t index[4];  // block j's scale among the chunk's (j * 32 / group), found once (as the avx2 tier's)
  explicit I4Scales(int64_t g) {
    for (int j = 0; j < 4; ++j) index[j] = j * 32 / g;
  }
  F16 operator()(const uint16_t* s, int64_t count) const {
    return fmap4([&](int j) { return vdupq_n_f32(index[j] < count ? bf16_to_float(s[index[j]]) : 0.f); });
  }
};
inline F16 i4dot(F16 acc, const I4W& w, F16 wscale, const uint8_t* x, const int32_t* corr, const float* xscale) {
  const int8_t* xs = reinterpret_cast<const int8_t*>(x);
  return fmap4([&](int j) {
    int32x4_t d = quads(w.lo[j], vld1q_s8(xs + 16 * j), vld1q_s32(corr + 4 * j));
    d = quads(w.hi[j], vld1q_s8(xs + 64 + 16 * j), d);
    return vfmaq_f32(acc.q[j], vcvtq_f32_s32(d), vmulq_f32(vld1q_f32(xscale + 4 * j), wscale.q[j]));
  });
}

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

}  // namespace
