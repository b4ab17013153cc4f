// Helpers shared by the XLA FFI handlers: status and dtype conversion, and joining an exchange
// as an asynchronous FFI result.
#ifndef JAX_HYBRIDEP_XLA_FFI_FFI_SUPPORT_H_
#define JAX_HYBRIDEP_XLA_FFI_FFI_SUPPORT_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/numeric.h"
#include "xla_ffi/rendezvous.h"

namespace jax_hybridep {
namespace ffi = xla::ffi;

inline ffi::Error ToError(const Status& status) {
  switch (status.code) {
    case Status::Code::kOk:
      return ffi::Error::Success();
    case Status::Code::kDeadlineExceeded:
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, status.message);
    case Status::Code::kFailedPrecondition:
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, status.message);
    case Status::Code::kAborted:
      break;
  }
  return ffi::Error(ffi::ErrorCode::kAborted, status.message);
}

inline ffi::ErrorOr<Dtype> ToDtype(ffi::DataType type, const char* what) {
  switch (type) {
    case ffi::DataType::F32:
      return Dtype::kF32;
    case ffi::DataType::BF16:
      return Dtype::kBF16;
    case ffi::DataType::F16:
      return Dtype::kF16;
    default:
      return ffi::Unexpected(ffi::Error::InvalidArgument(std::string("jax_hybridep: ") + what +
                                                         " must be float32, bfloat16 or float16"));
  }
}

inline ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

// Where this call meets its peers: (execution, call site, EP group, this rank).
struct CallSite {
  ffi::RunId run_id;
  int64_t site;
  int32_t group;
  int32_t rank;
  int64_t num_ranks;
  int64_t timeout_ms;
};

inline CallSite MakeCallSite(ffi::RunId run_id, ffi::Buffer<ffi::S32> rank,
                             ffi::Buffer<ffi::S32> group, int64_t site, int64_t num_ranks,
                             int64_t timeout_ms) {
  return {run_id, site, group.typed_data()[0], rank.typed_data()[0], num_ranks, timeout_ms};
}

// Joins the exchange; the returned future completes when this rank's read step has run. The
// handler returns at once, so a device thread never waits for its peers (see rendezvous.h).
inline ffi::Future Exchange(const char* name, const CallSite& call, Participant participant) {
  ffi::Promise promise;
  ffi::Future future(promise);
  participant.done = [promise](const Status& status) mutable {
    if (status.ok()) {
      promise.SetAvailable();
    } else {
      promise.SetError(ToError(status));
    }
  };
  JoinExchange(name, call.run_id.run_id, call.site, call.group, call.rank, call.num_ranks,
               std::chrono::milliseconds(call.timeout_ms), std::move(participant));
  return future;
}

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_FFI_SUPPORT_H_
