// abort_watch.h — a rank's thread that stops its kernels the moment its group aborts.
//
// The daemon (a peer lost or left, shutdown) and this rank's own host (the daemon lost) abort a
// group on its control segment, in host memory, which kernels read only once an abort-poll
// interval (sync.cuh). This thread sleeps on the abort word (a futex: no polling) and, once it is
// set, writes this rank's "asked to stop" word (layout.h) from a side stream of this process's
// context, which runs beside the waiting kernel at once; the kernel's wait reads that word at its
// next clock check. (The daemon writing it would wait for its context's turn on a GPU that the
// rank's kernels keep busy.) It also raises the service path's "done" word past any value: the
// daemon's stream may never write it (the daemon is gone, or its stream waits on a rank that is),
// and this rank's stream must not wait on it for ever. Outputs of work in flight are undefined
// after an abort, as with any collective library.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#include "../control.h"
#include "driver.h"
#include "layout.h"
#include "stream_words.h"

namespace nodecomm::cuda {

class AbortWatch {
 public:
  // `buffer`: this rank's buffer, as mapped on `device`.
  AbortWatch(std::uintptr_t control, int device, std::uintptr_t buffer)
      : control_(control), device_(device), buffer_(buffer) {
    prepare_write_now(device);
    thread_ = std::thread([this] { run(); });
  }

  // Stops the thread and waits for what it wrote, so that the buffer can be unmapped after.
  ~AbortWatch() {
    stopping_.store(true, std::memory_order_release);
    control::wake_abort_waiters(control_);
    thread_.join();
    try {
      finish_writes_now(device_);
    } catch (...) {
      // A device that fails this has failed the rank's own work too, which its caller sees.
    }
  }

  AbortWatch(const AbortWatch&) = delete;
  AbortWatch& operator=(const AbortWatch&) = delete;

 private:
  void run() {
    std::uint32_t reason = 0;
    while (reason == 0) {
      if (stopping_.load(std::memory_order_acquire)) return;
      reason = control::wait_for_abort(control_);
    }
    try {
      ask_to_stop(device_, buffer_);
      write_word_now(device_, buffer_ + kServiceDoneOffset, kServiceReleased);
    } catch (...) {
      // The kernels still see the abort word within an abort-poll interval; nothing to report to.
    }
  }

  std::uintptr_t control_;
  int device_;
  std::uintptr_t buffer_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace nodecomm::cuda
