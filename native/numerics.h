// numerics.h — element conversions shared by every transport.
//
// The numerics contract: every lossless path widens each element to fp32, adds ranks in the fixed
// order 0..n-1, and rounds once to the element type. The conversions below are bit-for-bit the
// ones PyTorch uses on the CPU (c10::BFloat16 round-to-nearest-even, and the FP16 library's
// fp16_ieee_{from,to}_fp32_value), so results can be checked against a torch reference by bits.
#pragma once

#include <cstdint>
#include <cstring>

namespace nodecomm {

// Element type codes; equal to nodecomm.v1.DType values.
enum class DType : int { kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

inline std::size_t dtype_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

struct BFloat16 { std::uint16_t bits; };
struct Float16 { std::uint16_t bits; };

inline std::uint32_t float_bits(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return bits_float(std::uint32_t(x.bits) << 16); }

inline float to_float(Float16 x) {
  const std::uint32_t w = std::uint32_t(x.bits) << 16;
  const std::uint32_t sign = w & 0x80000000u;
  const std::uint32_t two_w = w + w;
  const float exp_scale = bits_float(0x07800000u);  // 2^-112
  const float normalized = bits_float((two_w >> 4) + (0xE0u << 23)) * exp_scale;
  const float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const std::uint32_t result =
      sign | (two_w < (1u << 27) ? float_bits(denormalized) : float_bits(normalized));
  return bits_float(result);
}

template <typename T> T from_float(float x);

template <> inline float from_float<float>(float x) { return x; }

template <> inline BFloat16 from_float<BFloat16>(float x) {
  const std::uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return {0x7FC0};  // NaN, as c10 spells it
  return {std::uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

template <> inline Float16 from_float<Float16>(float x) {
  const float scale_to_inf = bits_float(0x77800000u);   // 2^112
  const float scale_to_zero = bits_float(0x08800000u);  // 2^-110
  float base = ((x < 0 ? -x : x) * scale_to_inf) * scale_to_zero;
  const std::uint32_t w = float_bits(x);
  const std::uint32_t shl1_w = w + w;
  const std::uint32_t sign = w & 0x80000000u;
  std::uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const std::uint32_t bits = float_bits(base);
  const std::uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return {std::uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}

}  // namespace nodecomm
