// dispatch_table.h — the dispatch table a rank holds: size ranges -> path and wire (as the daemon
// sent it), and the size buckets its evidence and exploration count in (dispatch.h decides by it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "codes.h"
#include "errors.h"
#include "wire.h"

namespace nodecomm::dispatch {

// Size ranges -> path and wire. range_max[i] is inclusive; the last range is unbounded.
struct Table {
  std::uint64_t epoch = 0;
  std::vector<std::uint64_t> range_max;
  std::vector<Path> range_paths;        // range_max.size() + 1
  std::vector<wire::Wire> range_wires;  // as range_paths
  wire::Wire wire = wire::Wire::kLossless;  // the compressed wire the group asked for
  std::int64_t compressed_min = -1;         // compressed_min_bytes; -1: none
  // Per size bucket (bucket_of), a mask (1 << Path) of the paths the daemon found slower there than
  // the table's by its margin: exploration leaves them to its rare refresh. Empty: none.
  std::vector<unsigned> settled;

  bool is_settled(int bucket, int path) const {
    return std::size_t(bucket) < settled.size() && (settled[bucket] >> path & 1u);
  }

  std::size_t index(std::uint64_t nbytes) const {  // the first range whose end is >= nbytes
    std::size_t low = 0, high = range_max.size();
    while (low < high) {
      const std::size_t mid = (low + high) / 2;
      if (range_max[mid] < nbytes) low = mid + 1; else high = mid;
    }
    return low;
  }
  Path path_for(std::uint64_t nbytes) const { return range_paths[index(nbytes)]; }
  wire::Wire wire_for(std::uint64_t nbytes) const { return range_wires[index(nbytes)]; }

  // For a group that asked for a compressed wire: the other wire within a factor of 4 of
  // compressed_min_bytes; -1 elsewhere.
  int wire_neighbour(std::uint64_t nbytes) const {
    if (wire == wire::Wire::kLossless || compressed_min < 0) return -1;
    const auto start = std::uint64_t(compressed_min);
    if (nbytes < start / 4 || nbytes > 4 * start) return -1;
    return int(wire_for(nbytes) != wire::Wire::kLossless ? wire::Wire::kLossless : wire);
  }
};

inline Table make_table(std::uint64_t epoch, std::vector<std::uint64_t> range_max, const std::vector<int>& paths,
                        const std::vector<int>& wires, int group_wire, std::int64_t compressed_min,
                        std::vector<unsigned> settled = {}) {
  Table table;
  table.epoch = epoch;
  NODECOMM_CHECK(paths.size() == range_max.size() + 1, "a table needs one path more than range ends");
  NODECOMM_CHECK(wires.empty() || wires.size() == paths.size(), "a table's wires, where given, are one per range");
  for (std::size_t i = 1; i < range_max.size(); ++i)
    NODECOMM_CHECK(range_max[i - 1] < range_max[i], "a table's range ends must increase");
  table.range_max = std::move(range_max);
  for (int code : paths) table.range_paths.push_back(path_of(code));
  for (std::size_t i = 0; i < paths.size(); ++i)
    table.range_wires.push_back(wires.empty() ? wire::Wire::kLossless : wire::wire_of(wires[i]));
  table.wire = wire::wire_of(group_wire);
  table.compressed_min = compressed_min;
  table.settled = std::move(settled);
  return table;
}

// Size buckets, as the daemon keeps its evidence (service/metrics/families.py SIZE_BUCKETS): powers of 4
// from 1 KiB to 256 MiB, then one for everything larger.
constexpr int kBuckets = 11;

inline int bucket_of(std::uint64_t nbytes) {
  int bucket = 0;
  for (std::uint64_t top = 1024; bucket < kBuckets - 1 && nbytes > top; top <<= 2) ++bucket;
  return bucket;
}

inline std::uint64_t bucket_low(int bucket) { return bucket == 0 ? 0 : (std::uint64_t(1024) << 2 * (bucket - 1)) + 1; }
inline std::uint64_t bucket_high(int bucket) {
  return bucket == kBuckets - 1 ? ~std::uint64_t(0) : std::uint64_t(1024) << 2 * bucket;
}

// Whether two tables send some size in [low, high] to different paths or wires. Both are constant
// between their range ends, so comparing where each piece of either starts is exact.
inline bool routes_differ(const Table& a, const Table& b, std::uint64_t low, std::uint64_t high) {
  auto differ_at = [&](std::uint64_t n) { return a.path_for(n) != b.path_for(n) || a.wire_for(n) != b.wire_for(n); };
  if (differ_at(low)) return true;
  for (const Table* table : {&a, &b})
    for (std::uint64_t end : table->range_max)
      if (end >= low && end < high && differ_at(end + 1)) return true;
  return false;
}

}  // namespace nodecomm::dispatch
