// topk_rows.h — which rows of a top-k stage each owner gets, as the service executors (CPU and
// CUDA) lay out owner tables: owner o owns rows [o * per, min((o + 1) * per, rows)) with
// per = ceil(rows / ranks), possibly none (nodecomm/topk_layout.py states the same rule).
#pragma once

#include <algorithm>
#include <cstddef>

namespace nodecomm {

struct OwnedRows {
  std::size_t first;
  std::size_t count;
};

inline OwnedRows owned_rows(std::size_t rows, std::size_t ranks, std::size_t owner) {
  const std::size_t per = (rows + ranks - 1) / ranks;
  const std::size_t first = std::min(rows, owner * per);
  return {first, std::min(rows, first + per) - first};
}

}  // namespace nodecomm
