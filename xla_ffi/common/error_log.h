// Failures the handlers return to XLA, also kept here for Python: JAX turns every handler error
// into one generic runtime error, so jax_hybridep.check_errors() reads this log to raise the
// library's own exception types (StrictModeError, TransportError) with the same message.
// Framework-free and thread-safe; identical messages (every rank of a group reports the same
// failure) are kept once, and at most kMaxRecordedErrors are kept until they are taken.
#ifndef JAX_HYBRIDEP_XLA_FFI_COMMON_ERROR_LOG_H_
#define JAX_HYBRIDEP_XLA_FFI_COMMON_ERROR_LOG_H_

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace jax_hybridep {

enum class ErrorKind : int {
  kStrictMode = 1,  // a strict-mode dispatch dropped rows or saw invalid ids
  kTransport = 2,   // an exchange failed: ranks did not arrive within the timeout
};

constexpr size_t kMaxRecordedErrors = 16;

void RecordError(ErrorKind kind, const std::string& message);

// The recorded errors, oldest first; the log is empty afterwards.
std::vector<std::pair<ErrorKind, std::string>> TakeRecordedErrors();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_COMMON_ERROR_LOG_H_
