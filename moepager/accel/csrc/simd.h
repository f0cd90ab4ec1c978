// The one seam between moepager's CPU kernels and the instruction set they run on. Every kernel (rows.h, experts.h,
// step.h) is written once against the operations below; a tier is one header implementing them, and the build
// (accel/cpu_kernels.py) compiles the kernels once per tier with that tier's target flags into a module of its own,
// loaded only on a CPU that can run it:
//   avx512-bf16  simd_avx512.h    AVX-512 F/BW/VL/DQ with AVX512-BF16 and AVX512-VNNI
//   avx2         simd_avx2.h      AVX2, FMA, F16C (x86-64-v3)
//   neon         simd_neon.h      ARM64 Advanced SIMD, with the dot-product instructions where built for them
//   portable     simd_portable.h  plain C++ over arrays (any compiler, any CPU)
//
// The operations (all inline, in each tier's anonymous namespace):
//   F16   16 fp32 lanes: fzero fset1 fload fstore (a count n: the first min(n, 16) lanes, the rest 0), fload_bf16,
//         fstore_bf16 (vcvtneps2bf16's rounding: nearest even, subnormals to a signed zero, NaN quieted),
//         fround_bf16, + - * /, ffma (a * b + c, fused), ffnma (c - a * b, fused), fmax / fmin (x86's: a > b ? a : b),
//         fround_int (nearest even), fscale2 (p * 2^n), fsum / fmaxall (one fixed tree: lanes i and i + 8, then i + 4,
//         i + 2, i + 1), fnonfinite, ffind.
//   B32   32 bf16: bload; bdot(acc, w, x) adds to lane i w[2i+1] x[2i+1] and then w[2i] x[2i], each rounded once
//         (vdpbf16ps's order, measured on Zen 5).
//   I8W   64 int8 weights: i8load, i8dot(acc, w, x, scale): lane i += float(sum of w[4i..4i+3] x[4i..4i+3]) * scale[i].
//   I4W   64 bytes of int4 nibbles: i4load, i4scales, i4dot (rows.h's int4 layout).
// Integer sums are exact and every float operation is one IEEE operation in a fixed order, so the tiers give the
// same bits. Two exceptions, stated where the tests allow for them: AVX512-BF16's dot products treat subnormal
// bf16 inputs and products as zero (the other tiers keep them), and NaN inputs may come out as other NaNs.
#pragma once

#include "scalar.h"

#if defined(MOEPAGER_TIER_AVX512)
#include "simd_avx512.h"
#elif defined(MOEPAGER_TIER_AVX2)
#include "simd_avx2.h"
#elif defined(MOEPAGER_TIER_NEON)
#include "simd_neon.h"
#elif defined(MOEPAGER_TIER_PORTABLE)
#include "simd_portable.h"
#else
#error "build with one of -DMOEPAGER_TIER_AVX512, -DMOEPAGER_TIER_AVX2, -DMOEPAGER_TIER_NEON, -DMOEPAGER_TIER_PORTABLE"
#endif

namespace {

// v with the lanes past the first n set to `fill` (a tail's lanes, outside any hot loop).
inline F16 ffill(F16 v, int64_t n, float fill) {
  if (n >= 16) return v;
  float t[16];
  fstore(t, v);
  for (int64_t i = n < 0 ? 0 : n; i < 16; ++i) t[i] = fill;
  return fload(t);
}

// e^x for x in [-88, 88] (clamped): 2^n p(r), n = round(x log2 e), r = x - n ln 2 in [-ln2/2, ln2/2] (Cody-Waite).
inline F16 fexp(F16 x) {
  x = fmax(fmin(x, fset1(88.f)), fset1(-88.f));
  const F16 n = fround_int(x * fset1(1.44269504088896341f));
  F16 r = ffnma(n, fset1(0.693359375f), x);
  r = ffnma(n, fset1(-2.12194440e-4f), r);
  F16 p = fset1(1.9875691500e-4f);
  p = ffma(p, r, fset1(1.3981999507e-3f));
  p = ffma(p, r, fset1(8.3334519073e-3f));
  p = ffma(p, r, fset1(4.1665795894e-2f));
  p = ffma(p, r, fset1(1.6666665459e-1f));
  p = ffma(p, r, fset1(5.0000001201e-1f));
  p = ffma(p, r * r, r + fset1(1.f));
  return fscale2(p, n);
}

}  // namespace
