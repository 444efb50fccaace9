// service.h — the daemon's host executor for the service path: collectives that ranks submit and
// the daemon runs on their registered host memory, one call per collective, no peer waiting (the
// daemon has matched every rank's part before it calls). Addresses are the daemon's mappings of
// the ranks' allocations, in rank order; the caller has bounds-checked every range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "errors.h"
#include "numerics.h"
#include "shm.h"
#include "topk_rows.h"

namespace nodecomm::service {

// Elements per step: the reduced chunk is still in cache when it is copied to the other outputs.
constexpr std::size_t kChunkBytes = 256 << 10;

inline void check_ranks(const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs) {
  NODECOMM_CHECK(!inputs.empty() && inputs.size() <= std::size_t(kMaxRanks),
                 "expected 1.." + std::to_string(kMaxRanks) + " inputs, got " + std::to_string(inputs.size()));
  NODECOMM_CHECK(inputs.size() == outputs.size(), "expected one output per input, got " +
                                                      std::to_string(outputs.size()) + " for " +
                                                      std::to_string(inputs.size()));
}

template <typename T>
void all_reduce_typed(const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs,
                      std::size_t count) {
  const int n = int(inputs.size());
  const std::uint8_t* sources[kMaxRanks];
  for (int r = 0; r < n; ++r) sources[r] = reinterpret_cast<const std::uint8_t*>(inputs[r]);
  T* first = reinterpret_cast<T*>(outputs[0]);
  const std::size_t step = kChunkBytes / sizeof(T);
  for (std::size_t begin = 0; begin < count; begin += step) {
    const std::size_t end = std::min(count, begin + step);
    // An output may be its rank's input (same indices): each chunk is read by every rank before
    // any output of it is written.
    shm::reduce_range<T>(sources, n, first, begin, end);
    for (int r = 1; r < n; ++r) {
      std::memcpy(reinterpret_cast<T*>(outputs[r]) + begin, first + begin, (end - begin) * sizeof(T));
    }
  }
}

// Every output gets the sum of every input: fp32 accumulation in rank order 0..n-1, one rounding,
// the same bits as the shm and CUDA paths.
inline void all_reduce(const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs,
                       std::size_t count, DType dtype) {
  check_ranks(inputs, outputs);
  for_dtype<HostElements>(dtype, [&](auto element) {
    all_reduce_typed<typename decltype(element)::type>(inputs, outputs, count);
  });
}

// Rank r's nbytes land at outputs[q] + r * nbytes for every q.
inline void all_gather(const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs,
                       std::size_t nbytes) {
  check_ranks(inputs, outputs);
  const std::size_t n = inputs.size();
  for (std::size_t q = 0; q < n; ++q) {
    for (std::size_t r = 0; r < n; ++r) {
      std::memcpy(reinterpret_cast<std::uint8_t*>(outputs[q]) + r * nbytes,
                  reinterpret_cast<const std::uint8_t*>(inputs[r]), nbytes);
    }
  }
}

// The top-k owner exchange: inputs[s] holds source s's [rows, topk] int32 indices followed by its
// [rows, topk] float32 scores; outputs[o] gets owner o's table, [owned, n, topk] indices followed by
// [owned, n, topk] scores, owner o's rows as topk_rows.h gives them. Scores move as bits.
inline void topk_stage(const std::vector<std::uintptr_t>& inputs, const std::vector<std::uintptr_t>& outputs,
                       std::size_t rows, std::size_t topk) {
  check_ranks(inputs, outputs);
  const std::size_t n = inputs.size();
  const std::size_t row_bytes = topk * 4;
  for (std::size_t owner = 0; owner < n; ++owner) {
    const auto [first, owned] = owned_rows(rows, n, owner);
    auto* out = reinterpret_cast<std::uint8_t*>(outputs[owner]);
    const std::size_t plane = owned * n * row_bytes;  // bytes of the owner's index plane
    for (std::size_t s = 0; s < n; ++s) {
      const auto* in = reinterpret_cast<const std::uint8_t*>(inputs[s]);
      for (std::size_t i = 0; i < owned; ++i) {
        const std::size_t from = (first + i) * row_bytes;
        const std::size_t to = (i * n + s) * row_bytes;
        std::memcpy(out + to, in + from, row_bytes);                                // indices
        std::memcpy(out + plane + to, in + rows * row_bytes + from, row_bytes);     // scores
      }
    }
  }
}

}  // namespace nodecomm::service
