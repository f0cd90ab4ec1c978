// The portable tier of simd.h: plain C++ over arrays of 16 lanes, for any CPU and compiler (built without target
// flags, and -ffp-contract=off as every tier: a fused multiply-add happens only where std::fma says so). It is the
// reference the other tiers are checked against (tests/accel, csrc/harness.cpp), and the fallback of a CPU with
// none of them. Where the target has no fused multiply-add instruction (x86-64 before FMA3), std::fma is a library
// call and this tier is slow.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr const char* TIER = "portable";

struct F16 {
  float v[16];
};
template <class Op>
inline F16 fmap(Op op) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = op(i);
  return r;
}
inline F16 fzero() { return fmap([](int) { return 0.f; }); }
inline F16 fset1(float a) { return fmap([a](int) { return a; }); }
inline F16 fload(const float* p, int64_t n = 16) { return fmap([&](int i) { return i < n ? p[i] : 0.f; }); }
inline void fstore(float* p, F16 a, int64_t n = 16) {
  for (int i = 0; i < 16 && i < n; ++i) p[i] = a.v[i];
}
inline F16 fload_bf16(const uint16_t* p, int64_t n = 16) {
  return fmap([&](int i) { return i < n ? bf16_to_float(p[i]) : 0.f; });
}
inline uint16_t cvtne_bf16(float f) {  // vcvtneps2bf16: NaN quieted, subnormals to a signed zero, else nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);
  return float_to_bf16(f);
}
inline void fstore_bf16(uint16_t* p, F16 a, int64_t n = 16) {
  for (int i = 0; i < 16 && i < n; ++i) p[i] = cvtne_bf16(a.v[i]);
}
inline F16 fround_bf16(F16 a) { return fmap([&](int i) { return bf16_to_float(cvtne_bf16(a.v[i])); }); }
inline F16 operator+(F16 a, F16 b) { return fmap([&](int i) { return a.v[i] + b.v[i]; }); }
inline F16 operator-(F16 a, F16 b) { return fmap([&](int i) { return a.v[i] - b.v[i]; }); }
inline F16 operator*(F16 a, F16 b) { return fmap([&](int i) { return a.v[i] * b.v[i]; }); }
inline F16 operator/(F16 a, F16 b) { return fmap([&](int i) { return a.v[i] / b.v[i]; }); }
inline F16 ffma(F16 a, F16 b, F16 c) { return fmap([&](int i) { return std::fma(a.v[i], b.v[i], c.v[i]); }); }
inline F16 ffnma(F16 a, F16 b, F16 c) { return fmap([&](int i) { return std::fma(-a.v[i], b.v[i], c.v[i]); }); }
inline F16 fmax(F16 a, F16 b) { return fmap([&](int i) { return a.v[i] > b.v[i] ? a.v[i] : b.v[i]; }); }
inline F16 fmin(F16 a, F16 b) { return fmap([&](int i) { return a.v[i] < b.v[i] ? a.v[i] : b.v[i]; }); }
inline F16 fround_int(F16 a) { return fmap([&](int i) { return std::nearbyint(a.v[i]); }); }
inline F16 fscale2(F16 p, F16 n) { return fmap([&](int i) { return std::ldexp(p.v[i], static_cast<int>(n.v[i])); }); }
template <class Op>
inline float ftree(F16 a, Op op) {  // lanes i and i + 8, then i + 4, i + 2, i + 1
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = op(a.v[i], a.v[i + 8]);
  for (int i = 0; i < 4; ++i) t[i] = op(t[i], t[i + 4]);
  for (int i = 0; i < 2; ++i) t[i] = op(t[i], t[i + 2]);
  return op(t[0], t[1]);
}
inline float fsum(F16 a) { return ftree(a, [](float x, float y) { return x + y; }); }
inline float fmaxall(F16 a) { return ftree(a, [](float x, float y) { return x > y ? x : y; }); }
inline bool fnonfinite(F16 a, int64_t n) {
  for (int i = 0; i < 16 && i < n; ++i)
    if (!std::isfinite(a.v[i])) return true;
  return false;
}
inline int ffind(F16 a, float target, int64_t n) {
  for (int i = 0; i < 16 && i < n; ++i)
    if (a.v[i] == target) return i;
  return -1;
}

struct B32 {
  uint16_t v[32];
};
inline B32 bload(const uint16_t* p, int64_t n = 32) {
  B32 r;
  for (int i = 0; i < 32; ++i) r.v[i] = i < n ? p[i] : 0;
  return r;
}
inline F16 bdot(F16 acc, const B32& w, const B32& x) {
  return fmap([&](int i) {
    const float a = std::fma(bf16_to_float(w.v[2 * i + 1]), bf16_to_float(x.v[2 * i + 1]), acc.v[i]);
    return std::fma(bf16_to_float(w.v[2 * i]), bf16_to_float(x.v[2 * i]), a);
  });
}

struct I8W {
  int8_t v[64];
};
inline I8W i8load(const int8_t* p, int64_t n = 64) {
  I8W r;
  for (int i = 0; i < 64; ++i) r.v[i] = i < n ? p[i] : 0;
  return r;
}
inline F16 i8dot(F16 acc, const I8W& w, const int8_t* x, const float* scale) {
  return fmap([&](int i) {
    int32_t d = 0;
    for (int j = 4 * i; j < 4 * i + 4; ++j) d += int32_t(w.v[j]) * int32_t(x[j]);
    return std::fma(static_cast<float>(d), scale[i], acc.v[i]);
  });
}

struct I4W {
  uint8_t lo[64], hi[64];
};
inline I4W i4load(const uint8_t* p, int64_t n = 64) {
  I4W r;
  for (int i = 0; i < 64; ++i) {
    const uint8_t b = i < n ? p[i] : 0;
    r.lo[i] = b & 15;
    r.hi[i] = b >> 4;
  }
  return r;
}
struct I4Scales {
  int64_t group;
  explicit I4Scales(int64_t g) : group(g) {}
  F16 operator()(const uint16_t* s, int64_t count) const {
    return fmap([&](int i) {
      const int64_t at = (i / 4) * 32 / group;
      return at < count ? bf16_to_float(s[at]) : 0.f;
    });
  }
};
inline F16 i4dot(F16 acc, const I4W& w, F16 wscale, const uint8_t* x, const int32_t* corr, const float* xscale) {
  const int8_t* xe = reinterpret_cast<const int8_t*>(x);
  const int8_t* xo = xe + 64;
  return fmap([&](int i) {
    int32_t d = corr[i];
    for (int j = 4 * i; j < 4 * i + 4; ++j) d += int32_t(w.lo[j]) * xe[j] + int32_t(w.hi[j]) * xo[j];
    return std::fma(static_cast<float>(d), xscale[i] * wscale.v[i], acc.v[i]);
  });
}

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

}  // namespace
