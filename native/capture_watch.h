// capture_watch.h — a rank's thread that makes an abort loud when CUDA graphs hold the group's calls.
//
// A replayed graph runs its kernels without a nodecomm call, so no call raises after an abort:
// the kernels stop at once (they honour the abort and stop words) and leave their outputs as they
// were, and an engine that decodes on would serve those. This thread watches the abort word and,
// once the group aborts while this rank has captured calls (control.h), writes one line on stderr
// naming the group, the rank and the reason, then by default ends the process, as torch's NCCL
// watchdog does on a failed collective; under the "log" policy it only writes the line, and the
// engine learns it from Communicator.check() or its next call. A peer that left (Leave, an orderly
// shutdown) is no failure: the line comes only once a kernel of this rank stopped without its
// result after it (its error record, which a replay sets), since the engine may be shutting down.
//
// The daemon and this rank's host wake the futex when they abort the group; a kernel that gives up
// writes the word from the device, which wakes nothing, so the thread also looks every kPoll once
// the rank has captured calls (every kIdlePoll before: a group only called eagerly needs no watch).
#pragma once

#include <unistd.h>

#include <linux/futex.h>
#include <sys/syscall.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>
#include <string>
#include <thread>

#include "control.h"

namespace nodecomm::control {

// The process's exit status when the policy ends it: EX_TEMPFAIL, a failure that a restart of the
// job may not meet again.
inline constexpr int kCapturedAbortExit = 75;

enum class CapturedAbortPolicy : int { kExit = 1, kLog = 2 };

class CaptureWatch {
 public:
  // `where`: "[group 'g', rank r]", the line's prefix.
  CaptureWatch(std::uintptr_t control, int rank, std::string where, CapturedAbortPolicy policy)
      : control_(control), rank_(rank), where_(std::move(where)), policy_(policy) {
    thread_ = std::thread([this] { run(); });
  }

  // Stops the thread: called before this rank leaves, so that its own leaving is not watched. The
  // thread may be between its look at the stop word and its sleep on the abort word, where one
  // wake is lost: wake it until it has gone.
  ~CaptureWatch() {
    __atomic_store_n(&stop_, 1u, __ATOMIC_RELEASE);
    while (!gone_.load(std::memory_order_acquire)) {
      wake_abort_waiters(control_);
      syscall(SYS_futex, &stop_, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    thread_.join();
  }

  CaptureWatch(const CaptureWatch&) = delete;
  CaptureWatch& operator=(const CaptureWatch&) = delete;

 private:
  static constexpr timespec kPoll{0, 20 * 1000 * 1000};
  static constexpr timespec kIdlePoll{1, 0};

  bool stopping() const { return __atomic_load_n(&stop_, __ATOMIC_ACQUIRE) != 0; }

  // Sleep on the stop word (the abort word is set by now, so a wait on it would not sleep).
  void pause(const timespec& period) { syscall(SYS_futex, &stop_, FUTEX_WAIT, 0, &period, nullptr, 0); }

  void run() {
    while (!stopping()) {
      const std::uint64_t captured = captured_calls(control_, rank_);
      const std::uint32_t reason = wait_for_abort(control_, captured ? &kPoll : &kIdlePoll);
      if (reason == 0 || stopping()) continue;
      // Looked at again after the abort: a call captured as it came is counted after its enqueue.
      const std::uint64_t now_captured = captured_calls(control_, rank_);
      if (now_captured == 0) {
        pause(kIdlePoll);  // eager calls raise at the next call; none is captured after an abort
      } else if (reason == kPeerLeft && error_record(control_, rank_).code == kErrorNone) {
        pause(kPoll);
      } else {
        speak(reason, now_captured);
        break;
      }
    }
    gone_.store(true, std::memory_order_release);
  }

  void speak(std::uint32_t reason, std::uint64_t captured) const {
    const std::string message = abort_error(control_, reason, abort_state(control_).second).second;
    std::string line = "nodecomm: " + where_ + " " + message + "; " + std::to_string(captured) +
                       " captured calls of this group now replay without their result: ";
    line += policy_ == CapturedAbortPolicy::kExit
                ? "ending the process (exit status " + std::to_string(kCapturedAbortExit) +
                      "; NODECOMM_CAPTURED_ABORT=log keeps it running)\n"
                : "Communicator.check() raises (NODECOMM_CAPTURED_ABORT=log)\n";
    for (std::size_t written = 0; written < line.size();) {
      const ssize_t n = ::write(STDERR_FILENO, line.data() + written, line.size() - written);
      if (n <= 0) break;
      written += std::size_t(n);
    }
    if (policy_ == CapturedAbortPolicy::kExit) ::_exit(kCapturedAbortExit);
  }

  std::uintptr_t control_;
  int rank_;
  std::string where_;
  CapturedAbortPolicy policy_;
  std::uint32_t stop_ = 0;  // a futex word: 1 once the watch is to stop
  std::atomic<bool> gone_{false};
  std::thread thread_;
};

}  // namespace nodecomm::control
