// XLA FFI handlers (platform Host) for one direct-write exchange level.
//
// Every device of an EP group calls the same handler at the same time on its own thread; they meet
// in a process-wide rendezvous (rendezvous.h) and write straight into each other's buffers. The
// EP rank and group arrive as operands (from axis_index), never from the device ordinal.
#include "xla_ffi/cpu_handlers.h"

#include <chrono>
#include <sstream>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/exchange.h"
#include "xla_ffi/layout.h"
#include "xla_ffi/rendezvous.h"

namespace jax_hybridep {
namespace ffi = xla::ffi;
namespace {

ffi::Error ToError(const Status& status) {
  if (status.ok) return ffi::Error::Success();
  return ffi::Error(
      status.deadline_exceeded ? ffi::ErrorCode::kDeadlineExceeded : ffi::ErrorCode::kAborted,
      status.message);
}

ffi::ErrorOr<Dtype> ToDtype(ffi::DataType type, const char* what) {
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

std::string FormatList(const std::vector<int64_t>& values) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  out << "]";
  return out.str();
}

// The ranks of one exchange: join, publish, write into peers, wait, read, leave.
class Exchange {
 public:
  Exchange(const char* name, ffi::RunId run_id, int64_t site, int32_t group, int32_t rank,
           int64_t num_ranks, int64_t timeout_ms)
      : rank_(rank),
        num_ranks_(num_ranks),
        timeout_(timeout_ms),
        rendezvous_(JoinRendezvous(name, run_id.run_id, site, group, rank, num_ranks)) {}
  ~Exchange() { LeaveRendezvous(rendezvous_, num_ranks_); }

  ffi::Error Arrive(const Published& mine) {
    return ToError(rendezvous_->Arrive(rank_, mine, timeout_));
  }
  ffi::Error Depart() { return ToError(rendezvous_->Depart(rank_, timeout_)); }
  template <typename T>
  T* Peer(int64_t rank, int64_t index = 0) const {
    return static_cast<T*>(rendezvous_->Peer(rank, index));
  }
  template <typename T>
  std::vector<T*> Peers(int64_t index = 0) const {
    std::vector<T*> peers(num_ranks_);
    for (int64_t r = 0; r < num_ranks_; ++r) peers[r] = Peer<T>(r, index);
    return peers;
  }

 private:
  const int32_t rank_;
  const int64_t num_ranks_;
  const std::chrono::milliseconds timeout_;
  std::shared_ptr<Rendezvous> rendezvous_;
};

// Layout: all-gather per-(source rank, expert) counts through the rendezvous, then assign rows.
ffi::Error LayoutImpl(ffi::RunId run_id, ffi::Buffer<ffi::S32> topk_idx,
                      ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf, int64_t site,
                      int64_t num_ranks, int64_t num_slots, int64_t capacity, int64_t rows,
                      int64_t pad_multiple, ffi::Span<const int64_t> expert_rank,
                      ffi::Span<const int64_t> expert_slot, bool strict, int64_t timeout_ms,
                      ffi::ResultBuffer<ffi::S32> row_pos, ffi::ResultBuffer<ffi::S32> group_sizes,
                      ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                      ffi::ResultBuffer<ffi::S32> dropped, ffi::ResultBuffer<ffi::S32> invalid) {
  const int64_t tokens = topk_idx.dimensions()[0], k = topk_idx.dimensions()[1];
  const int64_t num_experts = static_cast<int64_t>(expert_rank.size());
  const int32_t rank = rank_buf.typed_data()[0], group = group_buf.typed_data()[0];
  const Placement placement{expert_rank.begin(), expert_slot.begin(), num_experts, num_ranks,
                            num_slots};

  // Published: this rank's counts, E per-expert entries then the invalid-id count.
  std::vector<int32_t> mine(num_experts + 1);
  mine[num_experts] =
      static_cast<int32_t>(CountRows(topk_idx.typed_data(), tokens, k, num_experts, mine.data()));
  std::vector<int32_t> all_counts(num_ranks * num_experts);
  std::vector<int64_t> invalid_per_rank(num_ranks);
  {
    Exchange exchange("layout", run_id, site, group, rank, num_ranks, timeout_ms);
    if (ffi::Error err = exchange.Arrive({mine.data()}); err.failure()) return err;
    for (int64_t r = 0; r < num_ranks; ++r) {
      const int32_t* theirs = exchange.Peer<int32_t>(r);
      std::copy(theirs, theirs + num_experts, all_counts.begin() + r * num_experts);
      invalid_per_rank[r] = theirs[num_experts];
    }
    if (ffi::Error err = exchange.Depart(); err.failure()) return err;
  }

  std::vector<int32_t> keep_limit(num_experts), group_offset(num_experts);
  std::vector<int32_t> all_group_sizes(num_ranks * num_slots);
  PlanGroups(all_counts.data(), placement, CapacityPlan{capacity, rows, pad_multiple},
             keep_limit.data(), group_offset.data(), all_group_sizes.data(),
             tokens_per_expert->typed_data());
  const int64_t my_dropped =
      AssignRows(topk_idx.typed_data(), tokens, k, rank, all_counts.data(), placement,
                 keep_limit.data(), group_offset.data(), row_pos->typed_data());
  std::copy(all_group_sizes.begin() + rank * num_slots,
            all_group_sizes.begin() + (rank + 1) * num_slots, group_sizes->typed_data());
  dropped->typed_data()[0] = static_cast<int32_t>(my_dropped);
  invalid->typed_data()[0] = static_cast<int32_t>(invalid_per_rank[rank]);

  if (strict) {
    std::vector<int64_t> dropped_per_rank(num_ranks);
    DroppedPerSource(all_counts.data(), num_ranks, num_experts, keep_limit.data(),
                     dropped_per_rank.data());
    int64_t total_dropped = 0, total_invalid = 0;
    for (int64_t r = 0; r < num_ranks; ++r) {
      total_dropped += dropped_per_rank[r];
      total_invalid += invalid_per_rank[r];
    }
    if (total_dropped + total_invalid > 0) {
      // Must match jax_hybridep/errors.py:strict_mode_message word for word.
      std::ostringstream msg;
      msg << "jax_hybridep strict mode: " << total_dropped << " row(s) dropped over capacity and "
          << total_invalid << " invalid expert id(s) in EP group " << group
          << "; dropped per EP rank " << FormatList(dropped_per_rank) << ", invalid per EP rank "
          << FormatList(invalid_per_rank);
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, msg.str());
    }
  }
  return ffi::Error::Success();
}

// Dispatch: one copy per (token, destination rank) into the destination's receive buffer, then
// the destination expands it into expert-major rows.
ffi::Error DispatchImpl(ffi::RunId run_id, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> weights,
                        ffi::Buffer<ffi::S32> row_pos, ffi::Buffer<ffi::S32> dest,
                        ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                        int64_t site, int64_t num_ranks, int64_t timeout_ms,
                        ffi::Result<ffi::AnyBuffer> tokens, ffi::ResultBuffer<ffi::F32> row_weights,
                        ffi::ResultBuffer<ffi::S32> recv_row_pos,
                        ffi::ResultBuffer<ffi::S32> recv_token) {
  if (auto dtype = ToDtype(x.element_type(), "x"); dtype.has_error()) return dtype.error();
  const int64_t T = x.dimensions()[0];
  const ExchangeShape shape{num_ranks, T, row_pos.dimensions()[1], tokens->dimensions()[0],
                            static_cast<int64_t>(x.size_bytes()) / T};
  const int32_t rank = rank_buf.typed_data()[0], group = group_buf.typed_data()[0];

  std::vector<char> staged_tokens(shape.ranks * T * shape.row_bytes);
  std::vector<float> staged_weights(shape.ranks * T * shape.k);
  DispatchRecvBuffer mine{staged_tokens.data(), recv_token->typed_data(),
                          recv_row_pos->typed_data(), staged_weights.data()};
  ClearRecvMetadata(shape, mine.token_ids, mine.row_pos);

  Exchange exchange("dispatch", run_id, site, group, rank, num_ranks, timeout_ms);
  if (ffi::Error err = exchange.Arrive({&mine}); err.failure()) return err;
  WriteTokens(shape, rank, static_cast<const char*>(x.untyped_data()), dest.typed_data(),
              row_pos.typed_data(), weights.typed_data(),
              exchange.Peers<DispatchRecvBuffer>().data());
  if (ffi::Error err = exchange.Depart(); err.failure()) return err;
  ExpandRows(shape, mine, static_cast<char*>(tokens->untyped_data()), row_weights->typed_data());
  return ffi::Error::Success();
}

// Combine: each destination sums its rows per received token and writes the partial into the
// source's buffer; the source adds the partials in ascending destination rank.
ffi::Error CombineImpl(ffi::RunId run_id, ffi::AnyBuffer y, ffi::Buffer<ffi::F32> weights,
                       ffi::Buffer<ffi::S32> recv_token, ffi::Buffer<ffi::S32> recv_row_pos,
                       ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> rank_buf,
                       ffi::Buffer<ffi::S32> group_buf, int64_t site, int64_t num_ranks,
                       bool weighted, int64_t timeout_ms, ffi::Result<ffi::AnyBuffer> out) {
  auto dtype = ToDtype(y.element_type(), "y");
  if (dtype.has_error()) return dtype.error();
  const int64_t T = out->dimensions()[0], C = y.dimensions()[0];
  const ExchangeShape shape{num_ranks, T, dest.dimensions()[1], C,
                            static_cast<int64_t>(out->size_bytes()) / T};
  const int32_t rank = rank_buf.typed_data()[0], group = group_buf.typed_data()[0];

  std::vector<char> partials(shape.ranks * T * shape.row_bytes);
  Exchange exchange("combine", run_id, site, group, rank, num_ranks, timeout_ms);
  if (ffi::Error err = exchange.Arrive({partials.data()}); err.failure()) return err;
  WritePartials(shape, rank, dtype.value(), static_cast<const char*>(y.untyped_data()),
                weighted ? weights.typed_data() : nullptr, recv_token.typed_data(),
                recv_row_pos.typed_data(), exchange.Peers<char>().data());
  if (ffi::Error err = exchange.Depart(); err.failure()) return err;
  ReducePartials(shape, dtype.value(), partials.data(), dest.typed_data(),
                 static_cast<char*>(out->untyped_data()));
  return ffi::Error::Success();
}

// Returns one float per row to the (t, k) it came from (the routing-weight gradient).
ffi::Error ReturnRowValuesImpl(ffi::RunId run_id, ffi::Buffer<ffi::F32> values,
                               ffi::Buffer<ffi::S32> recv_token, ffi::Buffer<ffi::S32> recv_row_pos,
                               ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                               int64_t site, int64_t num_ranks, int64_t timeout_ms,
                               ffi::ResultBuffer<ffi::F32> out) {
  const int64_t T = out->dimensions()[0], K = out->dimensions()[1];
  const ExchangeShape shape{num_ranks, T, K, values.dimensions()[0], 0};
  const int32_t rank = rank_buf.typed_data()[0], group = group_buf.typed_data()[0];
  std::fill(out->typed_data(), out->typed_data() + T * K, 0.0f);

  Exchange exchange("row values", run_id, site, group, rank, num_ranks, timeout_ms);
  if (ffi::Error err = exchange.Arrive({out->typed_data()}); err.failure()) return err;
  WriteRowValues(shape, values.typed_data(), recv_token.typed_data(), recv_row_pos.typed_data(),
                 exchange.Peers<float>().data());
  return exchange.Depart();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kLayout, LayoutImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Arg<ffi::Buffer<ffi::S32>>()  // topk_idx [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attr<int64_t>("site")
                           .Attr<int64_t>("num_ranks")
                           .Attr<int64_t>("num_slots")
                           .Attr<int64_t>("capacity")
                           .Attr<int64_t>("rows")
                           .Attr<int64_t>("pad_multiple")
                           .Attr<ffi::Span<const int64_t>>("expert_rank")
                           .Attr<ffi::Span<const int64_t>>("expert_slot")
                           .Attr<bool>("strict")
                           .Attr<int64_t>("timeout_ms")
                           .Ret<ffi::Buffer<ffi::S32>>()    // row_pos [T, K]
                           .Ret<ffi::Buffer<ffi::S32>>()    // group_sizes [E_local]
                           .Ret<ffi::Buffer<ffi::S32>>()    // tokens_per_expert [E]
                           .Ret<ffi::Buffer<ffi::S32>>()    // dropped []
                           .Ret<ffi::Buffer<ffi::S32>>());  // invalid []

XLA_FFI_DEFINE_HANDLER(kDispatch, DispatchImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Arg<ffi::AnyBuffer>()         // x [T, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // row_pos [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attr<int64_t>("site")
                           .Attr<int64_t>("num_ranks")
                           .Attr<int64_t>("timeout_ms")
                           .Ret<ffi::AnyBuffer>()           // tokens [C, H]
                           .Ret<ffi::Buffer<ffi::F32>>()    // row_weights [C]
                           .Ret<ffi::Buffer<ffi::S32>>()    // recv_row_pos [R, T, K]
                           .Ret<ffi::Buffer<ffi::S32>>());  // recv_token [R, T]

XLA_FFI_DEFINE_HANDLER(kCombine, CombineImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Arg<ffi::AnyBuffer>()         // y [C, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_token [R, T]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_row_pos [R, T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attr<int64_t>("site")
                           .Attr<int64_t>("num_ranks")
                           .Attr<bool>("weighted")
                           .Attr<int64_t>("timeout_ms")
                           .Ret<ffi::AnyBuffer>());  // out [T, H]

XLA_FFI_DEFINE_HANDLER(kReturnRowValues, ReturnRowValuesImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Arg<ffi::Buffer<ffi::F32>>()  // values [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_token [R, T]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_row_pos [R, T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attr<int64_t>("site")
                           .Attr<int64_t>("num_ranks")
                           .Attr<int64_t>("timeout_ms")
                           .Ret<ffi::Buffer<ffi::F32>>());  // out [T, K]

std::vector<HandlerEntry> CpuHandlers() {
  return {
      {"jax_hybridep_layout", kLayout},
      {"jax_hybridep_dispatch", kDispatch},
      {"jax_hybridep_combine", kCombine},
      {"jax_hybridep_return_row_values", kReturnRowValues},
  };
}

}  // namespace jax_hybridep
