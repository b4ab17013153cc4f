// Helpers shared by the XLA FFI handlers: status and dtype conversion, and joining an exchange
// as an asynchronous FFI result.
#ifndef JAX_HYBRIDEP_XLA_FFI_COMMON_FFI_SUPPORT_H_
#define JAX_HYBRIDEP_XLA_FFI_COMMON_FFI_SUPPORT_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/error_log.h"
#include "xla_ffi/common/layout.h"
#include "xla_ffi/common/numeric.h"
#include "xla_ffi/common/rendezvous.h"

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

// How a handler writes the rows of its output: in `dtype`, dequantising FP8 wire rows of
// `dequantized_hidden` elements into them (RowOutputs::fp8_hidden; 0: none to dequantise).
struct OutputRows {
  Dtype dtype;
  int64_t dequantized_hidden;
};

// The output rows of a handler whose rows travel as FP8 wire rows of H = fp8_hidden (0: not FP8).
// Into a 16-bit or float32 output they are dequantised; into a uint8 output
// (DispatchConfig(fp8_rows=True)) they are delivered as they travel, only copied: nothing is
// dequantised and the dtype is a placeholder never read.
inline ffi::ErrorOr<OutputRows> ToOutputRows(ffi::DataType out_type, int64_t fp8_hidden,
                                             const char* what) {
  if (out_type == ffi::DataType::U8 && fp8_hidden > 0) return OutputRows{Dtype::kF32, 0};
  auto dtype = ToDtype(out_type, what);
  if (dtype.has_error()) return ffi::Unexpected(std::move(dtype.error()));
  return OutputRows{dtype.value(), fp8_hidden};
}

// combine's VJP reads y[row] beside each row of the output cotangent g it writes: y must be
// [rows, H] in g's dtype (rows of row_bytes bytes).
inline ffi::Error CheckVjpY(ffi::AnyBuffer y, ffi::DataType g_type, int64_t rows,
                            int64_t row_bytes) {
  const auto dims = y.dimensions();
  if (y.element_type() == g_type && dims.size() == 2 && dims[0] == rows &&
      static_cast<int64_t>(y.size_bytes()) == rows * row_bytes) {
    return ffi::Error::Success();
  }
  std::ostringstream msg;
  msg << "jax_hybridep: combine's VJP needs y as [" << rows << ", H] rows of " << row_bytes
      << " bytes in its output cotangent's dtype; got " << dims.size() << "-d y of "
      << y.size_bytes() << " bytes";
  if (y.element_type() != g_type) msg << " in another dtype";
  return ffi::Error::InvalidArgument(msg.str());
}

inline ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

// Attributes are decoded as one struct per handler (`.Attrs<T>()`), built from two bundles that
// mirror jax_hybridep/exchange/ffi_call.py (exchange_attrs, layout_attrs); the registrations at
// the end of this file name the members.

// An exchange's meeting point: the attributes of every exchange-only handler.
struct ExchangeAttrs {
  int64_t site;        // call-site id, one per emitted custom call
  int64_t num_ranks;   // ranks meeting there (the EP group, or one level's group)
  int64_t timeout_ms;  // how long each waits for the others before failing
};

// How the row-writing handlers write rows (RowOutputs): the rows left unwritten
// (sparse_pad_multiple; 0 unless DispatchConfig(zero_padding=False)) and whether the sources are
// FP8 wire rows of H elements (fp8_hidden = H, as the CUDA handlers name it; 0 otherwise),
// dequantised into the rows unless those are uint8 wire rows too. expand_items(_vjp).
struct RowAttrs {
  int64_t sparse_pad_multiple;
  int64_t fp8_hidden;
};

// dispatch, combine_vjp (one in-process level): the exchange, and how rows are written.
struct RowExchangeAttrs : ExchangeAttrs {
  int64_t sparse_pad_multiple;
  int64_t fp8_hidden;
};

// combine: the exchange, and whether the rows are weighted.
struct CombineAttrs : ExchangeAttrs {
  bool weighted;
};

// level_send: the exchange over one level, and that level's EP-rank stride.
struct LevelSendAttrs : ExchangeAttrs {
  int64_t stride;
};

// Where this call meets its peers: (execution, call site, group, this rank).
struct CallSite {
  ffi::RunId run_id;
  int64_t site;
  int32_t group;
  int32_t rank;
  int64_t num_ranks;
  int64_t timeout_ms;
};

inline CallSite MakeCallSite(ffi::RunId run_id, ffi::Buffer<ffi::S32> rank,
                             ffi::Buffer<ffi::S32> group, const ExchangeAttrs& exchange) {
  return {run_id,
          exchange.site,
          group.typed_data()[0],
          rank.typed_data()[0],
          exchange.num_ranks,
          exchange.timeout_ms};
}

// Joins the exchange; the returned future completes when this rank's read step has run. The
// handler returns at once, so a device thread never waits for its peers (see rendezvous.h).
inline ffi::Future Exchange(const char* name, const CallSite& call, Participant participant) {
  ffi::Promise promise;
  ffi::Future future(promise);
  participant.done = [promise](const Status& status) mutable {
    if (status.ok()) {
      promise.SetAvailable();
      return;
    }
    if (status.code == Status::Code::kDeadlineExceeded) {
      RecordError(ErrorKind::kTransport, status.message);
    }
    promise.SetError(ToError(status));
  };
  JoinExchange(name, call.run_id.run_id, call.site, call.group, call.rank, call.num_ranks,
               std::chrono::milliseconds(call.timeout_ms), std::move(participant));
  return future;
}

// The EP group's static plan: the attributes of layout_gathered. The spans point into the
// executable's attributes.
struct LayoutAttrsView {
  int64_t num_ranks;                                  // R, the EP size
  int64_t num_slots;                                  // local expert slots per rank
  int64_t capacity;                                   // rows kept per local expert, -1: dropless
  int64_t rows;                                       // C, rows of the expert-major buffer
  int64_t pad_multiple;                               // every group size is a multiple of it
  ffi::Span<const int64_t> expert_rank, expert_slot;  // placement, per expert
  bool strict;                                        // any drop or invalid id is an error
};

// layout: the plan, and where the EP group meets to gather its counts (num_ranks is the plan's).
struct LayoutExchangeAttrs : LayoutAttrsView {
  int64_t site, timeout_ms;
  ExchangeAttrs exchange() const { return {site, num_ranks, timeout_ms}; }
};

// The layout bundle, copied: the layout may run after the handler returned.
struct LayoutAttrs {
  int64_t num_ranks, num_slots, capacity, rows, pad_multiple;
  std::vector<int64_t> expert_rank, expert_slot;
  bool strict;
};

inline LayoutAttrs MakeLayoutAttrs(const LayoutAttrsView& b) {
  return {b.num_ranks,
          b.num_slots,
          b.capacity,
          b.rows,
          b.pad_multiple,
          std::vector<int64_t>(b.expert_rank.begin(), b.expert_rank.end()),
          std::vector<int64_t>(b.expert_slot.begin(), b.expert_slot.end()),
          b.strict};
}

// The same from flat attributes (the CUDA layout handler takes the bundle's members flat).
inline LayoutAttrs MakeLayoutAttrs(int64_t num_ranks, int64_t num_slots, int64_t capacity,
                                   int64_t rows, int64_t pad_multiple,
                                   ffi::Span<const int64_t> expert_rank,
                                   ffi::Span<const int64_t> expert_slot, bool strict) {
  return MakeLayoutAttrs(LayoutAttrsView{num_ranks, num_slots, capacity, rows, pad_multiple,
                                         expert_rank, expert_slot, strict});
}

inline std::string FormatList(const std::vector<int64_t>& values) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  out << "]";
  return out.str();
}

// The EP group's plan from the all-gathered counts [R, E + 1] (per expert, then the invalid-id
// count of each source rank): every rank computes the same.
struct GroupPlan {
  std::vector<int32_t> counts;                                       // [R, E]
  std::vector<int64_t> invalid_per_rank;                             // [R]
  std::vector<int32_t> keep_limit, group_offset, tokens_per_expert;  // [E]
  std::vector<int32_t> group_sizes;                                  // [R, slots]
};

inline Placement MakePlacement(const LayoutAttrs& attrs) {
  return {attrs.expert_rank.data(), attrs.expert_slot.data(),
          static_cast<int64_t>(attrs.expert_rank.size()), attrs.num_ranks, attrs.num_slots};
}

inline GroupPlan PlanGroup(const LayoutAttrs& attrs, const int32_t* gathered) {
  const int64_t num_ranks = attrs.num_ranks;
  const int64_t num_experts = static_cast<int64_t>(attrs.expert_rank.size());
  GroupPlan plan{std::vector<int32_t>(num_ranks * num_experts),
                 std::vector<int64_t>(num_ranks),
                 std::vector<int32_t>(num_experts),
                 std::vector<int32_t>(num_experts),
                 std::vector<int32_t>(num_experts),
                 std::vector<int32_t>(num_ranks * attrs.num_slots)};
  for (int64_t r = 0; r < num_ranks; ++r) {
    std::copy_n(gathered + r * (num_experts + 1), num_experts,
                plan.counts.begin() + r * num_experts);
    plan.invalid_per_rank[r] = gathered[r * (num_experts + 1) + num_experts];
  }
  PlanGroups(plan.counts.data(), MakePlacement(attrs),
             CapacityPlan{attrs.capacity, attrs.rows, attrs.pad_multiple}, plan.keep_limit.data(),
             plan.group_offset.data(), plan.group_sizes.data(), plan.tokens_per_expert.data());
  return plan;
}

// Strict mode: any drop or invalid id anywhere in the EP group is an error, the same on every rank
// and backend.
inline Status StrictCheck(const LayoutAttrs& attrs, const GroupPlan& plan, int32_t group) {
  const int64_t num_ranks = attrs.num_ranks;
  const int64_t num_experts = static_cast<int64_t>(attrs.expert_rank.size());
  std::vector<int64_t> dropped_per_rank(num_ranks);
  DroppedPerSource(plan.counts.data(), num_ranks, num_experts, plan.keep_limit.data(),
                   dropped_per_rank.data());
  int64_t total_dropped = 0, total_invalid = 0;
  for (int64_t r = 0; r < num_ranks; ++r) {
    total_dropped += dropped_per_rank[r];
    total_invalid += plan.invalid_per_rank[r];
  }
  if (total_dropped + total_invalid == 0) return Status::Ok();
  // Must match jax_hybridep/errors.py:strict_mode_message word for word.
  std::ostringstream msg;
  msg << "jax_hybridep strict mode: " << total_dropped << " row(s) dropped over capacity and "
      << total_invalid << " invalid expert id(s) in EP group " << group << "; dropped per EP rank "
      << FormatList(dropped_per_rank) << ", invalid per EP rank "
      << FormatList(plan.invalid_per_rank);
  RecordError(ErrorKind::kStrictMode, msg.str());
  return Status{Status::Code::kFailedPrecondition, msg.str()};
}

}  // namespace jax_hybridep

// Decoding by member name, in declaration order (bases first: aggregate initialisation).
#define JAX_HYBRIDEP_EXCHANGE_MEMBERS                                \
  StructMember<int64_t>("site"), StructMember<int64_t>("num_ranks"), \
      StructMember<int64_t>("timeout_ms")
#define JAX_HYBRIDEP_LAYOUT_MEMBERS                                                            \
  StructMember<int64_t>("num_ranks"), StructMember<int64_t>("num_slots"),                      \
      StructMember<int64_t>("capacity"), StructMember<int64_t>("rows"),                        \
      StructMember<int64_t>("pad_multiple"), StructMember<Span<const int64_t>>("expert_rank"), \
      StructMember<Span<const int64_t>>("expert_slot"), StructMember<bool>("strict")

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_hybridep::ExchangeAttrs, JAX_HYBRIDEP_EXCHANGE_MEMBERS);
#define JAX_HYBRIDEP_ROW_MEMBERS \
  StructMember<int64_t>("sparse_pad_multiple"), StructMember<int64_t>("fp8_hidden")
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_hybridep::RowAttrs, JAX_HYBRIDEP_ROW_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_hybridep::RowExchangeAttrs,
                                      JAX_HYBRIDEP_EXCHANGE_MEMBERS, JAX_HYBRIDEP_ROW_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_hybridep::CombineAttrs, JAX_HYBRIDEP_EXCHANGE_MEMBERS,
                                      StructMember<bool>("weighted"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_hybridep::LevelSendAttrs, JAX_HYBRIDEP_EXCHANGE_MEMBERS,
                                      StructMember<int64_t>("stride"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_hybridep::LayoutAttrsView, JAX_HYBRIDEP_LAYOUT_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_hybridep::LayoutExchangeAttrs,
                                      JAX_HYBRIDEP_LAYOUT_MEMBERS, StructMember<int64_t>("site"),
                                      StructMember<int64_t>("timeout_ms"));

#endif  // JAX_HYBRIDEP_XLA_FFI_COMMON_FFI_SUPPORT_H_
