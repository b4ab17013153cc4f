#include "xla_ffi/common/error_log.h"

#include <algorithm>
#include <mutex>

namespace jax_hybridep {
namespace {

struct Log {
  std::mutex mu;
  std::vector<std::pair<ErrorKind, std::string>> errors;
};

Log& TheLog() {
  static Log* log = new Log();  // never destroyed: handlers may record during shutdown
  return *log;
}

}  // namespace

void RecordError(ErrorKind kind, const std::string& message) {
  Log& log = TheLog();
  std::lock_guard<std::mutex> lock(log.mu);
  const auto entry = std::make_pair(kind, message);
  if (log.errors.size() >= kMaxRecordedErrors ||
      std::find(log.errors.begin(), log.errors.end(), entry) != log.errors.end()) {
    return;
  }
  log.errors.push_back(entry);
}

std::vector<std::pair<ErrorKind, std::string>> TakeRecordedErrors() {
  Log& log = TheLog();
  std::lock_guard<std::mutex> lock(log.mu);
  std::vector<std::pair<ErrorKind, std::string>> out;
  out.swap(log.errors);
  return out;
}

}  // namespace jax_hybridep
