// numerics.h — element conversions shared by every transport.
//
// The numerics contract: every lossless path widens each element to fp32, adds ranks in the fixed
// order 0..n-1, and rounds once to the element type. The conversions below round to nearest even
// like PyTorch's, so results can be checked against a torch reference by bits. NaN payloads are
// outside the contract (PyTorch's own scalar and vector conversions spell them differently); the
// CPU path writes one canonical NaN per type. fp16 goes through the compiler's _Float16, which
// becomes vcvtps2ph/vcvtph2ps and vectorises where F16C is enabled.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "codes.h"
#include "errors.h"

namespace nodecomm {

struct BFloat16 { std::uint16_t bits; };
struct Float16 { std::uint16_t bits; };

// The element types each side reduces: the host's, bit containers converted by the functions
// below, and the device's (cuda/numerics.cuh).
struct HostElements {
  using Float32 = float;
  using Float16 = nodecomm::Float16;
  using BFloat16 = nodecomm::BFloat16;
};

template <typename T>
struct ElementTag {
  using type = T;
};

// Calls fn(ElementTag<E>{}) with E the element type that `Elements` gives `dtype`: the one dtype
// dispatch of every transport. An unknown code is the caller's error.
template <typename Elements, typename Fn>
decltype(auto) for_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(ElementTag<typename Elements::Float32>{});
    case DType::kFloat16: return fn(ElementTag<typename Elements::Float16>{});
    case DType::kBFloat16: return fn(ElementTag<typename Elements::BFloat16>{});
  }
  NODECOMM_RAISE(kInvalidArgument, "unknown dtype code " + std::to_string(int(dtype)) +
                                       ": expected 1 (float32), 2 (float16) or 3 (bfloat16)");
}

inline std::uint32_t float_bits(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return bits_float(std::uint32_t(x.bits) << 16); }

inline float to_float(Float16 x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, 2);
  return float(h);
}

template <typename T> T from_float(float x);

template <> inline float from_float<float>(float x) { return x; }

template <> inline BFloat16 from_float<BFloat16>(float x) {
  const std::uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return {0x7FC0};  // canonical NaN
  return {std::uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

// IEEE round-to-nearest-even; NaN becomes 0x7E00 with its sign.
template <> inline Float16 from_float<Float16>(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  std::uint16_t bits;
  std::memcpy(&bits, &h, 2);
  if (x != x) bits = std::uint16_t((float_bits(x) >> 16 & 0x8000u) | 0x7E00u);
  return {bits};
}

}  // namespace nodecomm
