// world.h — the world size as a compile-time constant, for kernels that unroll over ranks.
#pragma once

#include <string>
#include <type_traits>

#include "../errors.h"
#include "../numerics.h"

namespace nodecomm::cuda {

inline constexpr int kWorldSizes[] = {1, 2, 3, 4, 5, 6, 7, 8, 16};

// Calls fn(std::integral_constant<int, world_size>{}): the world size as a compile-time constant.
template <typename Fn>
void for_world(int world_size, Fn&& fn) {
  switch (world_size) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    case 8: return fn(std::integral_constant<int, 8>{});
    case 16: return fn(std::integral_constant<int, 16>{});
  }
  NODECOMM_RAISE(kInvalidArgument, "CUDA paths support world sizes 1-8 and 16, got " + std::to_string(world_size));
}

// Calls fn(world, element): the world size as a compile-time constant and the element type of
// `Elements` for `dtype`, the instantiation of a kernel that a call launches.
template <typename Elements, typename Fn>
void for_instance(int world_size, DType dtype, Fn&& fn) {
  for_world(world_size, [&](auto world) { for_dtype<Elements>(dtype, [&](auto element) { fn(world, element); }); });
}

// Calls fn(world, element) for every world size and every element type of `Elements`: a kernel's
// every instantiation, for occupancy queries.
template <typename Elements, typename Fn>
void for_every_instance(Fn&& fn) {
  for (const int world_size : kWorldSizes) {
    for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      for_instance<Elements>(world_size, dtype, fn);
    }
  }
}

}  // namespace nodecomm::cuda
