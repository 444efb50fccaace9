// errors.h — the native side of nodecomm.errors. Each class maps 1:1 to a Python class there.
// An internal error (a broken invariant, a failing CUDA call) carries the file:line that raised it,
// for the bug report; the others are for the caller, who needs what was wrong, not where.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>

namespace nodecomm {

enum class ErrorKind {
  kInvalidArgument, kDeadlineExceeded, kPeerLost, kDaemonUnavailable, kResourceExhausted, kInternal, kGroupMismatch
};

struct Error : std::runtime_error {
  ErrorKind kind;
  Error(ErrorKind k, const std::string& message) : std::runtime_error(message), kind(k) {}
};

[[noreturn]] inline void raise(ErrorKind kind, const char* file, int line, const std::string& what) {
  if (kind != ErrorKind::kInternal) throw Error(kind, what);
  std::string where(file);
  const auto slash = where.find_last_of('/');
  if (slash != std::string::npos) where = where.substr(slash + 1);
  throw Error(kind, what + " (" + where + ":" + std::to_string(line) + ")");
}

// For a C ABI, which no exception may cross: run(), or `failed` with the error's kind and text.
template <typename Run>
int run_reporting(Run run, int failed, int* error_kind, char* message, std::size_t message_bytes) {
  try {
    return run();
  } catch (const Error& error) {
    *error_kind = int(error.kind);
    std::snprintf(message, message_bytes, "%s", error.what());
  } catch (const std::exception& error) {
    *error_kind = int(ErrorKind::kInternal);
    std::snprintf(message, message_bytes, "%s", error.what());
  }
  return failed;
}

}  // namespace nodecomm

#define NODECOMM_RAISE(kind, what) ::nodecomm::raise(::nodecomm::ErrorKind::kind, __FILE__, __LINE__, (what))
// A check of what the caller passed: InvalidArgument.
#define NODECOMM_CHECK(cond, what) \
  do { if (!(cond)) NODECOMM_RAISE(kInvalidArgument, what); } while (0)
// A check of nodecomm's own invariant, which no argument can break: InternalError.
#define NODECOMM_ASSERT(cond, what) \
  do { if (!(cond)) NODECOMM_RAISE(kInternal, what); } while (0)
