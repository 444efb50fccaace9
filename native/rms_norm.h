// rms_norm.h — the residual add and RMSNorm that follow an all-reduce, in the order stated by
// nodecomm/rms_norm.py (the reference the tests compare bits with): the CPU transport's, and the
// constants the CUDA kernels (cuda/rms_norm.cuh) share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "agreement.h"
#include "codes.h"
#include "errors.h"
#include "numerics.h"

namespace nodecomm::norm {

// Lane l adds the squares of chunks l, l + kLanes, ... (kChunk elements each), in order; the lanes
// then meet in a butterfly. A CUDA block of kLanes threads keeps the order loading whole chunks.
constexpr int kLanes = 512;
constexpr int kChunk = 8;
// Rows longer than this do not fit the ranks' call word (agreement.h packs the hidden size in 16 bits).
constexpr std::size_t kMaxHidden = 65535;

// One all_reduce_rms_norm call: `rows` rows of `hidden` elements in input, residual, out and
// residual_out, and weight's `hidden`. out may be input, residual_out may be residual.
struct Rows {
  std::uintptr_t input, residual, weight, out, residual_out;
  std::size_t rows, hidden;
  float eps;

  std::size_t count() const { return rows * hidden; }
  void check() const {
    NODECOMM_CHECK(hidden >= 1 && hidden <= kMaxHidden,
                   "hidden size " + std::to_string(hidden) + ": expected 1.." + std::to_string(kMaxHidden));
    NODECOMM_CHECK(rows < (std::size_t(1) << 24), "row count " + std::to_string(rows) + ": expected fewer than 2^24");
  }
  // The same rows once the all-reduce has put its sum in out: the norm's input.
  Rows summed() const {
    Rows after = *this;
    after.input = out;
    return after;
  }
  // What the ranks compare: the shape, not only the element count.
  Call call(DType dtype, Path path) const {
    return Call{Collective::kAllReduceRmsNorm, rows << 16 | hidden, int(dtype), int(path), 0};
  }
};

// 1 / sqrt(mean + eps) of one row's squares, from every lane's partial sum.
inline float inverse_rms(float (&partial)[kLanes], std::size_t hidden, float eps) {
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    float next[kLanes];
    for (int l = 0; l < kLanes; ++l) next[l] = partial[l] + partial[l ^ offset];
    for (int l = 0; l < kLanes; ++l) partial[l] = next[l];
  }
  return 1.0f / std::sqrt(partial[0] / float(hidden) + eps);
}

// residual_out = round(sum + residual); out = round(residual_out * inverse * weight), row by row.
// out may equal sum, residual_out may equal residual: each element is read before it is written.
template <typename T>
void add_rms_norm_rows(const T* sum, const T* residual, const T* weight, float eps, T* out, T* residual_out,
                       std::size_t rows, std::size_t hidden) {
  for (std::size_t row = 0; row < rows; ++row) {
    const std::size_t base = row * hidden;
    float partial[kLanes] = {};
    for (std::size_t chunk = 0; chunk * kChunk < hidden; ++chunk) {
      float& lane = partial[chunk % kLanes];
      for (std::size_t i = chunk * kChunk; i < std::min(hidden, (chunk + 1) * kChunk); ++i) {
        const T value = from_float<T>(to_float(sum[base + i]) + to_float(residual[base + i]));
        residual_out[base + i] = value;
        const float widened = to_float(value);
        lane += widened * widened;  // -ffp-contract=off: the product is rounded before the add
      }
    }
    const float inverse = inverse_rms(partial, hidden, eps);
    for (std::size_t i = 0; i < hidden; ++i) {
      out[base + i] = from_float<T>(to_float(residual_out[base + i]) * inverse * to_float(weight[i]));
    }
  }
}

// The add and norm of rows whose input already holds the all-reduce's sum.
inline void add_rms_norm(const Rows& rows, DType dtype) {
  rows.check();
  for_dtype<HostElements>(dtype, [&](auto element) {
    using T = typename decltype(element)::type;
    add_rms_norm_rows(reinterpret_cast<const T*>(rows.input), reinterpret_cast<const T*>(rows.residual),
                      reinterpret_cast<const T*>(rows.weight), rows.eps, reinterpret_cast<T*>(rows.out),
                      reinterpret_cast<T*>(rows.residual_out), rows.rows, rows.hidden);
  });
}

}  // namespace nodecomm::norm
