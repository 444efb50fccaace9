// wire.h — the compressed wire formats a group may opt in to (nodecomm.v1.Wire): each rank
// quantizes its input once, in blocks of kWireBlock elements with one fp32 scale each; a reader
// dequantizes every rank's blocks and sums them in fp32 in rank order 0..n-1, rounding once, so
// every rank gets the same bits, as on the lossless paths. Host and device code share these
// functions (plain fp32 multiplies and integer work, no fused multiply-adds), so the CPU and CUDA
// transports encode and decode the same bits.
//
//   int8  code = clamp(rint(x * 127/absmax), -127, 127); value = code * (absmax/127)
//   fp8   E4M3 (bias 7, 3 mantissa bits, largest 448, no infinity), round to nearest even:
//         code = e4m3(clamp(x * 448/absmax, -448, 448)); value = e4m3_value(code) * (absmax/448)
// absmax: the block's largest finite magnitude. A non-finite element is sent as NaN (int8 code
// -128, fp8 0x7F), so a block holding inf or NaN yields NaN there (E4M3 has no infinity); its
// finite elements are scaled as usual. A block whose finite magnitudes are all below 2^-100 is
// sent as zeros (scale 0): no scale or its inverse leaves the normal fp32 range.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "errors.h"

#ifdef __CUDACC__
#define NODECOMM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define NODECOMM_HOST_DEVICE inline
#endif

namespace nodecomm::wire {

// Equal to nodecomm.v1.Wire values.
enum class Wire : int { kLossless = 0, kInt8 = 1, kFp8 = 2 };

constexpr std::size_t kWireBlock = 32;  // elements per scale
constexpr std::uint8_t kInt8NaN = 0x80;  // -128, outside the codes of finite values
constexpr std::uint8_t kFp8NaN = 0x7F;
constexpr float kZeroBelow = 7.888609052210118e-31f;  // 2^-100

NODECOMM_HOST_DEVICE float code_limit(Wire wire) { return wire == Wire::kInt8 ? 127.0f : 448.0f; }

NODECOMM_HOST_DEVICE std::uint32_t bits_of(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

NODECOMM_HOST_DEVICE float float_of(std::uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

NODECOMM_HOST_DEVICE bool finite(float x) { return (bits_of(x) & 0x7F800000u) != 0x7F800000u; }

// fp32 -> E4M3, round to nearest even; |y| <= 448 (the caller clamps).
NODECOMM_HOST_DEVICE std::uint8_t e4m3_of(float y) {
  const std::uint32_t u = bits_of(y);
  const std::uint8_t sign = std::uint8_t((u >> 24) & 0x80u);
  const std::uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude < 0x3C800000u) {  // below 2^-6: subnormal codes m * 2^-9, m = 0..8 (8 is 2^-6)
    const float scaled = float_of(magnitude) * 512.0f;  // exact: a power of two
    return sign | std::uint8_t(rintf(scaled));
  }
  const std::uint32_t exponent = (magnitude >> 23) - 127 + 7;  // 1..15
  const std::uint32_t kept = (magnitude >> 20) & 7u, rest = magnitude & 0xFFFFFu;
  const std::uint32_t up = rest > 0x80000u || (rest == 0x80000u && (kept & 1u));
  std::uint32_t code = (exponent << 3) + kept + up;  // a carry moves to the next exponent
  if (code > 0x7Eu) code = 0x7Eu;                     // 448: only a rounding of 448 itself gets here
  return sign | std::uint8_t(code);
}

NODECOMM_HOST_DEVICE float e4m3_value(std::uint8_t code) {
  const std::uint32_t magnitude = code & 0x7Fu;
  const std::uint32_t sign = std::uint32_t(code & 0x80u) << 24;
  if (magnitude == 0x7Fu) return float_of(0x7FC00000u);
  const std::uint32_t exponent = magnitude >> 3, mantissa = magnitude & 7u;
  if (exponent == 0) return float_of(sign | bits_of(float(mantissa) * 0.001953125f));  // m * 2^-9
  return float_of(sign | ((exponent - 7 + 127) << 23) | (mantissa << 20));
}

// The scale a block of largest finite magnitude `absmax` is sent with (0: a block of zeros).
NODECOMM_HOST_DEVICE float block_scale(float absmax, Wire wire) {
  return absmax < kZeroBelow ? 0.0f : absmax / code_limit(wire);
}

// What x is sent as in a block of largest finite magnitude `absmax`.
NODECOMM_HOST_DEVICE std::uint8_t encode(float x, float absmax, Wire wire) {
  if (!finite(x)) return wire == Wire::kInt8 ? kInt8NaN : kFp8NaN;
  if (absmax < kZeroBelow) return 0;
  const float limit = code_limit(wire);
  const float y = fminf(fmaxf(x * (limit / absmax), -limit), limit);
  if (wire == Wire::kInt8) return std::uint8_t(std::int8_t(rintf(y)));
  return e4m3_of(y);
}

// a * b rounded once, never fused with the add that follows (nvcc contracts by default).
NODECOMM_HOST_DEVICE float multiply(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// The value a code stands for under `scale`.
NODECOMM_HOST_DEVICE float decode(std::uint8_t code, float scale, Wire wire) {
  if (wire == Wire::kInt8) {
    return code == kInt8NaN ? float_of(0x7FC00000u) : multiply(float(std::int8_t(code)), scale);
  }
  return multiply(e4m3_value(code), scale);
}

// Bytes a chunk of `count` elements takes on the wire: its codes (padded to 64 bytes), then one
// fp32 scale per block.
NODECOMM_HOST_DEVICE constexpr std::size_t blocks_of(std::size_t count) { return (count + kWireBlock - 1) / kWireBlock; }
NODECOMM_HOST_DEVICE constexpr std::size_t scales_offset(std::size_t count) { return (count + 63) / 64 * 64; }
NODECOMM_HOST_DEVICE constexpr std::size_t encoded_bytes(std::size_t count) { return scales_offset(count) + 4 * blocks_of(count); }
// What a rank's payload of `count` elements of `element_bytes` each carries on `wire`, as the
// operation counts report it: a byte per element and a scale per block, unpadded.
inline constexpr std::uint64_t payload_bytes(Wire wire, std::size_t count, std::size_t element_bytes) {
  return wire == Wire::kLossless ? count * element_bytes : count + 4 * blocks_of(count);
}
// Where a two-phase path keeps its reduced segment (in the element type) behind the encoding.
NODECOMM_HOST_DEVICE constexpr std::size_t reduced_offset(std::size_t count) { return (encoded_bytes(count) + 255) / 256 * 256; }
// The most elements of `element_bytes` one piece of a call takes where a slot has `capacity_bytes`:
// its encoding and, behind it, its reduced values fit, in whole multiples of 512.
NODECOMM_HOST_DEVICE constexpr std::size_t elements_per_slot(std::size_t capacity_bytes, std::size_t element_bytes) {
  return capacity_bytes / (element_bytes + 2) / 512 * 512;
}

inline Wire wire_of(int code) {
  NODECOMM_CHECK(code >= 0 && code <= 2, "unknown wire code " + std::to_string(code) +
                                             ": expected 0 (lossless), 1 (int8) or 2 (fp8)");
  return Wire(code);
}

inline const char* wire_name(int wire) {
  switch (Wire(wire)) {
    case Wire::kLossless: return "lossless";
    case Wire::kInt8: return "int8";
    case Wire::kFp8: return "fp8";
  }
  return "an unknown wire";
}

}  // namespace nodecomm::wire
