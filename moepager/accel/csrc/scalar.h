// Scalar helpers shared by every tier of moepager's CPU kernels: bf16 <-> fp32 as torch rounds them.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

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

}  // namespace
