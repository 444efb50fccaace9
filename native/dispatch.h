// dispatch.h — the one place that decides which path and wire carry a rank's all-reduce, and the
// counts of what each path carried, both on every call without Python. The table comes from the
// daemon (nodecomm/thresholds.py builds it; Python installs each one the ranks agree on); the
// rule is: the path the caller forced, or the table's for the size, now and then another lossless
// path instead (so the daemon gets timings of every path a size could take), never a path the
// stream cannot run (the service path under graph capture). Every rank makes the same calls in the
// same order, so every rank's Dispatch decides the same.
#pragma once

#include <array>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <map>
#include <tuple>
#include <vector>

#include "codes.h"
#include "dispatch_table.h"
#include "errors.h"
#include "wire.h"

namespace nodecomm::dispatch {

constexpr int kWires = 3;
constexpr int kOps = 8;  // nodecomm.v1.Op values are below this
constexpr int kAllReduce = 1;  // nodecomm.v1.ALL_REDUCE

inline const char* wire_name(wire::Wire w) {
  static const char* names[kWires] = {"lossless", "int8", "fp8"};
  return names[int(w)];
}

inline bool lossless_path(Path path) {  // paths that give the same bits, so exploring changes no result
  return path == Path::kOneshot || path == Path::kTwoshot || path == Path::kDma;
}

struct Decision {
  Path path;
  wire::Wire wire;
  bool explored;  // not the table's choice but a rival's: time it for the daemon
  bool sampled;   // time this call for the daemon
};

// Decides one rank's all-reduces. `paths` and `wire_paths` are bit masks (1 << Path) of what the
// rank runs and on which paths it carries compressed wires; `kind` ("cpu", "cuda") names the group
// in messages; every sample_period-th call is timed, after every switch_period-th the ranks agree
// on the newest table (0: never).
//
// Exploration (explore_period 0: off) is per size bucket, under the table in force: every
// explore_period-th table-dispatched call of a bucket runs on a rival instead, the one timed least
// there (every other lossless path this rank runs, and for a group with a compressed wire near
// compressed_min_bytes the other wire), and the call after it is timed on the table's own path,
// so that the daemon compares timings taken under the same conditions (a burst of load slows every
// path alike). Rivals the daemon settled (Table::settled) are left out; once all are, only every
// (explore_period * kRefresh)-th call explores, so that a settled table costs next to nothing and
// still notices when the machine changes. A new table restarts the counts in the buckets whose
// routing changed.
class Dispatch {
 public:
  static constexpr std::uint64_t kRefresh = 256;

  // Decides nothing until a table is installed.
  Dispatch(unsigned paths, unsigned wire_paths, std::string kind, std::uint64_t explore_period,
           std::uint64_t sample_period, std::uint64_t switch_period)
      : paths_(paths), wire_paths_(wire_paths), kind_(std::move(kind)), explore_period_(explore_period),
        sample_period_(sample_period ? sample_period : 1), switch_period_(switch_period) {
    for (auto& c : kind_) c = char(std::toupper(static_cast<unsigned char>(c)));
  }

  // Sizes probed for capture (Communicator.capture(), entered around an engine's capture phase, in
  // which it runs each shape eagerly before capturing it). While armed, the first eager call of a
  // size the table gives a lossless path is left to the caller (probe_due), which times every
  // lossless path this rank runs in CUDA graphs, agrees with its peers on the fastest and sets it
  // (set_probed); that size's calls captured later take it. Arming again forgets the last phase's.
  void arm_probes(bool armed) {
    if (armed) probed_.clear();
    probing_ = armed;
  }

  bool probe_due(std::uint64_t nbytes, int forced, int forced_wire, bool capturing) const {
    if (!probing_ || capturing || forced != 0 || forced_wire >= 0 || probed_.size() >= kMaxSizes) return false;
    const Path path = table_.path_for(nbytes);
    if (!lossless_path(path) || !runs(path) || table_.wire_for(nbytes) != wire::Wire::kLossless) return false;
    if (probed_.count(nbytes)) return false;
    for (Path rival : {Path::kOneshot, Path::kTwoshot, Path::kDma})
      if (rival != path && runs(rival)) return true;
    return false;
  }

  void set_probed(std::uint64_t nbytes, Path path) {
    NODECOMM_CHECK(lossless_path(path) && runs(path),
                   std::string("a probed size's path must be a lossless one this rank runs, not ") + path_name(path));
    probed_[nbytes] = path;
  }

  // Every size a table-decided call was captured at, and the path it took, where that changed
  // since the last take (empty otherwise): what the operator sees beside the table in force.
  std::vector<std::pair<std::uint64_t, int>> take_captured() {
    std::vector<std::pair<std::uint64_t, int>> taken;
    std::lock_guard<std::mutex> hold(counts_lock_);
    if (!captured_changed_) return taken;
    captured_changed_ = false;
    for (const auto& [nbytes, path] : captured_) taken.emplace_back(nbytes, int(path));
    return taken;
  }

  void install(Table table) {
    for (int b = 0; b < kBuckets; ++b)
      if (table_.range_paths.empty() || routes_differ(table_, table, bucket_low(b), bucket_high(b))) buckets_[b] = {};
    table_ = std::move(table);
  }
  const Table& table() const { return table_; }
  std::uint64_t calls() const { return calls_; }
  bool runs(Path path) const { return paths_ >> int(path) & 1u; }
  bool accepts(std::uint64_t nbytes) const { return runs(table_.path_for(nbytes)); }
  void refused() { ++calls_; }  // a call refused before it reached decide() counts all the same
  bool switch_due(bool capturing) const { return switch_period_ && calls_ % switch_period_ == 0 && !capturing; }

  // The last decided call failed: its bucket's counts are put back. Ranks that disagreed on a call
  // (a CPU group raises GroupMismatchError on every rank, and goes on) counted it in different
  // buckets; putting both back keeps every rank's exploration in step.
  void undo() {
    if (undone_ >= 0) buckets_[undone_] = before_;
    undone_ = -1;
  }

  // The next all-reduce of nbytes; forced: a path code or 0 (the table's); forced_wire: a wire code
  // or -1 (the table's). Counts the call, refused or not: every rank refuses the same ones.
  Decision decide(std::uint64_t nbytes, int forced, int forced_wire, bool capturing) {
    NODECOMM_ASSERT(!table_.range_paths.empty(), "a call was decided before any table was installed");
    ++calls_;
    undone_ = -1;
    const bool sampled = (calls_ - 1) % sample_period_ == 0;
    const wire::Wire wanted = forced_wire < 0 ? table_.wire_for(nbytes) : wire::wire_of(forced_wire);
    if (forced == 0 && forced_wire < 0 && !capturing) {
      undone_ = bucket_of(nbytes);
      before_ = buckets_[undone_];
      Decision decision = table_decision(nbytes, undone_, buckets_[undone_]);
      decision.sampled = decision.sampled || sampled;
      return decision;
    }
    Decision decision = path_decision(nbytes, forced, capturing);
    decision.sampled = sampled;
    if (capturing && forced == 0 && forced_wire < 0) decision.path = captured_path(nbytes, decision.path);
    if (wanted == wire::Wire::kLossless) return decision;
    if (!carries(decision.path)) {
      if (forced_wire < 0) return decision;  // the table's wire on a path this rank carries losslessly only
      std::string carriers;
      for (int p = 1; p < kPaths; ++p)
        if (carries(Path(p))) carriers += std::string(carriers.empty() ? "" : ", ") + path_name(Path(p));
      NODECOMM_RAISE(kInvalidArgument, std::string("wire '") + wire_name(wanted) + "' on the " +
                                           path_name(decision.path) + " path: a " + kind_ +
                                           " group carries compressed wires on " +
                                           (carriers.empty() ? "no path" : carriers));
    }
    decision.wire = wanted;
    return decision;
  }

  // The path of a call that is neither explored nor timed nor counted towards a table switch: the
  // forced one (a path code) or the table's, checked as decide() checks them; a captured call of
  // the table's takes its size's probed path, as decide() does. all_reduce_rms_norm takes its path
  // so: its timings are not an all-reduce's.
  Path fixed_path(std::uint64_t nbytes, int forced, bool capturing) {
    NODECOMM_ASSERT(!table_.range_paths.empty(), "a call was decided before any table was installed");
    const Path path = path_decision(nbytes, forced, capturing).path;
    return capturing && forced == 0 ? captured_path(nbytes, path) : path;
  }

  // One call of `op` on `path` over `wire`, moving nbytes of this rank's payload as wire_bytes.
  void count(int op, Path path, wire::Wire wire, std::uint64_t nbytes, std::uint64_t wire_bytes) {
    NODECOMM_CHECK(op >= 0 && op < kOps, "unknown op code " + std::to_string(op));
    std::lock_guard<std::mutex> hold(counts_lock_);  // the session thread takes them meanwhile
    Count& entry = counts_[op][int(path)][int(wire)];
    entry.operations += 1;
    entry.bytes += nbytes;
    entry.wire_bytes += wire_bytes;
  }

  // One sampled call's time, for the session to send; past kMaxSamples untaken, new ones are dropped
  // (a rank that samples faster than its session sends loses samples, not memory). Returns how many
  // are held.
  std::size_t record(Path path, wire::Wire wire, std::uint64_t nbytes, double seconds) {
    std::lock_guard<std::mutex> hold(counts_lock_);
    if (samples_.size() < kMaxSamples) samples_.push_back({int(path), int(wire), nbytes, seconds});
    return samples_.size();
  }

  std::size_t held() {  // samples not taken yet
    std::lock_guard<std::mutex> hold(counts_lock_);
    return samples_.size();
  }

  // (path, wire, bytes, seconds) of every sample since the last take.
  std::vector<std::tuple<int, int, std::uint64_t, double>> take_samples() {
    std::vector<Sample> taken;
    {
      std::lock_guard<std::mutex> hold(counts_lock_);
      taken.swap(samples_);
    }
    std::vector<std::tuple<int, int, std::uint64_t, double>> out;
    out.reserve(taken.size());
    for (const Sample& s : taken) out.emplace_back(s.path, s.wire, s.nbytes, s.seconds);
    return out;
  }

  // (op, path, wire, operations, bytes, wire_bytes) of every count since the last take, reset.
  std::vector<std::tuple<int, int, int, std::uint64_t, std::uint64_t, std::uint64_t>> take_counts() {
    std::vector<std::tuple<int, int, int, std::uint64_t, std::uint64_t, std::uint64_t>> taken;
    std::lock_guard<std::mutex> hold(counts_lock_);
    for (int op = 0; op < kOps; ++op)
      for (int path = 0; path < kPaths; ++path)
        for (int w = 0; w < kWires; ++w) {
          Count& entry = counts_[op][path][w];
          if (entry.operations == 0) continue;
          taken.emplace_back(op, path, w, entry.operations, entry.bytes, entry.wire_bytes);
          entry = Count{};
        }
    return taken;
  }

 private:
  static constexpr std::size_t kMaxSamples = 4096;
  static constexpr std::size_t kMaxSizes = 256;  // probed, and captured as the operator sees them

  // A table-decided call under capture: the probed path for its size, else the table's; recorded.
  Path captured_path(std::uint64_t nbytes, Path table_path) {
    const auto probed = probed_.find(nbytes);
    const Path path = probed != probed_.end() ? probed->second : table_path;
    std::lock_guard<std::mutex> hold(counts_lock_);
    const auto known = captured_.find(nbytes);
    if (known != captured_.end() ? known->second != path : captured_.size() < kMaxSizes) {
      captured_[nbytes] = path;
      captured_changed_ = true;
    }
    return path;
  }

  struct Count {
    std::uint64_t operations = 0, bytes = 0, wire_bytes = 0;
  };
  struct Sample {
    int path, wire;
    std::uint64_t nbytes;
    double seconds;
  };

  // Per size bucket, under the table in force: the calls it dispatched there, and how often each
  // rival (a path, or kPaths for the other wire) was timed.
  struct Bucket {
    std::uint64_t calls = 0;
    std::array<std::uint64_t, kPaths + 1> explored{};
    bool paired = false;  // the next call on the table's path is timed, beside the last explore
  };

  bool carries(Path path) const { return wire_paths_ >> int(path) & 1u; }

  // A call the table decides, outside any capture: now and then a rival instead (see the class).
  Decision table_decision(std::uint64_t nbytes, int index, Bucket& bucket) {
    Decision decision = path_decision(nbytes, 0, false);
    const wire::Wire wire = table_.wire_for(nbytes);
    if (wire != wire::Wire::kLossless && carries(decision.path)) decision.wire = wire;
    ++bucket.calls;
    if (explore_period_ && bucket.calls % explore_period_ == 0) {
      int open = -1, any = -1;  // the least timed rival not settled, and of all: a path, or kPaths for the wire
      auto consider = [&](int rival) {
        if (any < 0 || bucket.explored[rival] < bucket.explored[any]) any = rival;
        if (!table_.is_settled(index, rival) && (open < 0 || bucket.explored[rival] < bucket.explored[open]))
          open = rival;
      };
      const int other_wire = table_.wire_neighbour(nbytes);
      if (other_wire >= 0 && carries(decision.path) && runs(decision.path)) consider(kPaths);
      // A compressed call is not explored onto another path: path moves compare lossless timings.
      if (lossless_path(decision.path) && decision.wire == wire::Wire::kLossless)
        for (Path path : {Path::kOneshot, Path::kTwoshot, Path::kDma})
          if (path != decision.path && runs(path)) consider(int(path));
      const int rival = open >= 0 ? open : bucket.calls % (explore_period_ * kRefresh) == 0 ? any : -1;
      if (rival >= 0) {
        ++bucket.explored[rival];
        bucket.paired = open >= 0;
        if (rival == kPaths) return {decision.path, wire::Wire(other_wire), true, true};
        return {Path(rival), wire::Wire::kLossless, true, true};
      }
    }
    decision.sampled = bucket.paired;
    bucket.paired = false;
    return decision;
  }

  Decision path_decision(std::uint64_t nbytes, int forced, bool capturing) const {
    if (forced != 0) {
      const Path path = path_of(forced);
      NODECOMM_CHECK(runs(path), std::string("path '") + path_name(path) + "' is not available to a " + kind_ +
                                     " group");
      return {path, wire::Wire::kLossless, false, false};
    }
    const Path chosen = table_.path_for(nbytes);
    if (!runs(chosen)) {
      const std::string hint =
          chosen == Path::kNccl ? "; it runs NCCL itself for these sizes (ask accepts() first)" : "";
      NODECOMM_RAISE(kInvalidArgument, "the dispatch table sends " + std::to_string(nbytes) + " bytes to " +
                                           path_name(chosen) + ", which this rank cannot run" + hint);
    }
    if (chosen == Path::kService && capturing)
      NODECOMM_RAISE(kInvalidArgument,
                     "the dispatch table sends " + std::to_string(nbytes) +
                         " bytes to the service path (service_min_bytes), which a CUDA graph cannot capture; pass "
                         "path= for captured calls, or turn service_min_bytes off");
    return {chosen, wire::Wire::kLossless, false, false};
  }

  Table table_;
  unsigned paths_, wire_paths_;
  std::string kind_;
  std::uint64_t explore_period_, sample_period_, switch_period_;
  std::uint64_t calls_ = 0;
  std::array<Bucket, kBuckets> buckets_{};
  int undone_ = -1;  // the bucket the last call counted in, and its counts before: for undo()
  Bucket before_;
  bool probing_ = false;
  std::map<std::uint64_t, Path> probed_;
  std::mutex counts_lock_;  // guards counts_, samples_ and captured_
  std::map<std::uint64_t, Path> captured_;
  bool captured_changed_ = false;
  std::vector<Sample> samples_;
  std::array<std::array<std::array<Count, kWires>, kPaths>, kOps> counts_{};
};

}  // namespace nodecomm::dispatch
