// XLA FFI handlers (platform Host): layout, and dispatch/combine for one-level topologies.
//
// Every device of an EP group calls the same handler at the same time on its own thread; they meet
// in a process-wide rendezvous (rendezvous.h) and, once all have arrived, each reads straight from
// the others' inputs into its own outputs (exchange.h, "pull transport"). The EP rank and group
// arrive as operands (from axis_index), never from the device ordinal.
#include "xla_ffi/cpu/handlers/handlers.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_support.h"
#include "xla_ffi/common/fp8.h"
#include "xla_ffi/common/layout.h"
#include "xla_ffi/common/rendezvous.h"
#include "xla_ffi/cpu/kernels/exchange.h"

namespace jax_hybridep {
namespace ffi = xla::ffi;
namespace {

struct LayoutOutputs {
  int32_t *row_pos, *group_sizes, *tokens_per_expert, *dropped, *invalid;
};

// Assigns every (t, k) of `rank` its row from the gathered counts [R, E + 1] (per expert, then the
// invalid-id count), and fills the outputs; in strict mode, any drop or invalid id anywhere in the
// group is an error (the same on every rank).
Status ComputeLayout(const LayoutAttrs& attrs, const int32_t* topk_idx, int64_t tokens, int64_t k,
                     int32_t rank, int32_t group, const int32_t* gathered,
                     const LayoutOutputs& out) {
  const GroupPlan plan = PlanGroup(attrs, gathered);
  std::copy(plan.tokens_per_expert.begin(), plan.tokens_per_expert.end(), out.tokens_per_expert);
  out.dropped[0] = static_cast<int32_t>(AssignRows(topk_idx, tokens, k, rank, plan.counts.data(),
                                                   MakePlacement(attrs), plan.keep_limit.data(),
                                                   plan.group_offset.data(), out.row_pos));
  std::copy_n(plan.group_sizes.begin() + rank * attrs.num_slots, attrs.num_slots, out.group_sizes);
  out.invalid[0] = static_cast<int32_t>(plan.invalid_per_rank[rank]);
  return attrs.strict ? StrictCheck(attrs, plan, group) : Status::Ok();
}

// Layout: all-gather per-(source rank, expert) counts through the rendezvous, then assign rows.
ffi::Future LayoutImpl(ffi::RunId run_id, ffi::Buffer<ffi::S32> topk_idx,
                       ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                       LayoutExchangeAttrs layout, ffi::ResultBuffer<ffi::S32> row_pos,
                       ffi::ResultBuffer<ffi::S32> group_sizes,
                       ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                       ffi::ResultBuffer<ffi::S32> dropped, ffi::ResultBuffer<ffi::S32> invalid) {
  const CallSite call = MakeCallSite(run_id, rank, group, layout.exchange());
  const int64_t tokens = topk_idx.dimensions()[0], k = topk_idx.dimensions()[1];
  auto attrs = std::make_shared<LayoutAttrs>(MakeLayoutAttrs(layout));
  const int64_t num_ranks = attrs->num_ranks;
  const int64_t num_experts = static_cast<int64_t>(attrs->expert_rank.size());
  // This rank's counts, E per-expert entries then the invalid-id count; peers read them all.
  auto counts = std::make_shared<std::vector<int32_t>>(num_experts + 1);
  (*counts)[num_experts] = static_cast<int32_t>(
      CountRows(topk_idx.typed_data(), tokens, k, num_experts, counts->data()));
  auto gathered = std::make_shared<std::vector<int32_t>>(num_ranks * (num_experts + 1));

  Participant p;
  p.published = {counts->data()};
  p.write = [counts, gathered, num_experts](const std::vector<Published>& peers) {
    // Reading peers' counts here is safe: every rank's counts stay alive until all read steps.
    for (size_t r = 0; r < peers.size(); ++r) {
      const int32_t* theirs = static_cast<const int32_t*>(peers[r][0]);
      std::copy_n(theirs, num_experts + 1, gathered->begin() + r * (num_experts + 1));
    }
  };
  const LayoutOutputs out{row_pos->typed_data(), group_sizes->typed_data(),
                          tokens_per_expert->typed_data(), dropped->typed_data(),
                          invalid->typed_data()};
  p.read = [=, idx = topk_idx.typed_data()]() {
    return ComputeLayout(*attrs, idx, tokens, k, call.rank, call.group, gathered->data(), out);
  };
  return Exchange("layout", call, std::move(p));
}

// Layout from counts already all-gathered by an XLA collective (EP groups across processes).
ffi::Error LayoutGatheredImpl(ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::S32> gathered,
                              ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                              LayoutAttrsView layout, ffi::ResultBuffer<ffi::S32> row_pos,
                              ffi::ResultBuffer<ffi::S32> group_sizes,
                              ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                              ffi::ResultBuffer<ffi::S32> dropped,
                              ffi::ResultBuffer<ffi::S32> invalid) {
  const LayoutAttrs attrs = MakeLayoutAttrs(layout);
  const LayoutOutputs out{row_pos->typed_data(), group_sizes->typed_data(),
                          tokens_per_expert->typed_data(), dropped->typed_data(),
                          invalid->typed_data()};
  return ToError(ComputeLayout(attrs, topk_idx.typed_data(), topk_idx.dimensions()[0],
                               topk_idx.dimensions()[1], rank.typed_data()[0],
                               group.typed_data()[0], gathered.typed_data(), out));
}

// The one-level exchanges read straight from the peers (exchange.h, "pull transport"): each
// rank publishes its inputs; the write step only records the peers' pointers (every rank has
// arrived, so their inputs are ready and stay alive until every rank's read step has run), and
// each rank's read step produces its own outputs from them.
struct PeerInputs {
  std::vector<Published> peers;
};

std::function<void(const std::vector<Published>&)> RecordPeers(std::shared_ptr<PeerInputs> in) {
  return [in = std::move(in)](const std::vector<Published>& peers) { in->peers = peers; };
}

std::vector<SourceRows> Sources(const PeerInputs& in, bool with_weights) {
  std::vector<SourceRows> sources(in.peers.size());
  for (size_t r = 0; r < in.peers.size(); ++r) {
    const Published& p = in.peers[r];
    sources[r] = {static_cast<const char*>(p[0]), static_cast<const int32_t*>(p[1]),
                  static_cast<const int32_t*>(p[2]),
                  with_weights ? static_cast<const float*>(p[3]) : nullptr};
  }
  return sources;
}

// Dispatch: each destination copies every row it holds straight from its source's x (one copy
// per row).
ffi::Future DispatchImpl(ffi::RunId run_id, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> weights,
                         ffi::Buffer<ffi::S32> row_pos, ffi::Buffer<ffi::S32> dest,
                         ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                         RowExchangeAttrs exchange, ffi::Result<ffi::AnyBuffer> tokens,
                         ffi::ResultBuffer<ffi::F32> row_weights) {
  auto output = ToOutputRows(tokens->element_type(), exchange.fp8_hidden, "the rows");
  if (output.has_error()) return Failed(output.error());
  const OutputRows written = output.value();
  const CallSite call = MakeCallSite(run_id, rank, group, exchange);
  const int64_t T = x.dimensions()[0];
  const ExchangeShape shape{call.num_ranks, T, row_pos.dimensions()[1], tokens->dimensions()[0],
                            static_cast<int64_t>(x.size_bytes()) / T};
  auto in = std::make_shared<PeerInputs>();
  Participant p;
  p.published = {x.untyped_data(), dest.typed_data(), row_pos.typed_data(), weights.typed_data()};
  p.write = RecordPeers(in);
  p.read = [=, out = static_cast<char*>(tokens->untyped_data()),
            out_weights = row_weights->typed_data()]() {
    const std::vector<SourceRows> sources = Sources(*in, true);
    RowOutputs rows_out;
    rows_out.tokens = out;
    rows_out.weights = out_weights;
    rows_out.sparse_pad_multiple = exchange.sparse_pad_multiple;
    rows_out.fp8_hidden = written.dequantized_hidden;
    PullRows(shape, call.rank, sources.data(), written.dtype, rows_out);
    return Status::Ok();
  };
  return Exchange("dispatch", call, std::move(p));
}

// A weighted combine's VJP: along an existing layout, each row of the output cotangent g
// (dispatched, never stored) gives scaled = row * scale[row], the rows' gradient, and
// dot = RowDot(y[row], row), the routing weights' gradient (numeric.h's order), in one pass.
ffi::Future CombineVjpImpl(ffi::RunId run_id, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> scale,
                           ffi::AnyBuffer y, ffi::Buffer<ffi::S32> row_pos,
                           ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> rank,
                           ffi::Buffer<ffi::S32> group, RowExchangeAttrs exchange,
                           ffi::Result<ffi::AnyBuffer> scaled, ffi::ResultBuffer<ffi::F32> dot) {
  auto dtype = ToDtype(g.element_type(), "g");
  if (dtype.has_error()) return Failed(dtype.error());
  const int64_t T = g.dimensions()[0];
  const ExchangeShape shape{exchange.num_ranks, T, row_pos.dimensions()[1], scaled->dimensions()[0],
                            T > 0 ? static_cast<int64_t>(g.size_bytes()) / T : 0};
  if (ffi::Error error = CheckVjpY(y, g.element_type(), shape.rows, shape.row_bytes);
      error.failure()) {
    return Failed(std::move(error));
  }
  const CallSite call = MakeCallSite(run_id, rank, group, exchange);
  auto in = std::make_shared<PeerInputs>();
  Participant p;
  p.published = {g.untyped_data(), dest.typed_data(), row_pos.typed_data(), nullptr};
  p.write = RecordPeers(in);
  RowOutputs out;
  out.scale = scale.typed_data();
  out.scaled = static_cast<char*>(scaled->untyped_data());
  out.y = static_cast<const char*>(y.untyped_data());
  out.dot = dot->typed_data();
  out.sparse_pad_multiple = exchange.sparse_pad_multiple;
  p.read = [=]() {
    const std::vector<SourceRows> sources = Sources(*in, false);
    PullRows(shape, call.rank, sources.data(), dtype.value(), out);
    return Status::Ok();
  };
  return Exchange("combine vjp", call, std::move(p));
}

// Combine: each source sums, per token, its rows on each destination in ascending k (one
// partial per destination, rounded to y's dtype), and the partials in ascending destination.
ffi::Future CombineImpl(ffi::RunId run_id, ffi::AnyBuffer y, ffi::Buffer<ffi::F32> weights,
                        ffi::Buffer<ffi::S32> row_pos, ffi::Buffer<ffi::S32> dest,
                        ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group, CombineAttrs attrs,
                        ffi::Result<ffi::AnyBuffer> out) {
  const bool weighted = attrs.weighted;
  auto dtype = ToDtype(y.element_type(), "y");
  if (dtype.has_error()) return Failed(dtype.error());
  const CallSite call = MakeCallSite(run_id, rank, group, attrs);
  const int64_t T = out->dimensions()[0];
  const ExchangeShape shape{call.num_ranks, T, dest.dimensions()[1], y.dimensions()[0],
                            static_cast<int64_t>(out->size_bytes()) / T};
  auto in = std::make_shared<PeerInputs>();
  Participant p;
  p.published = {y.untyped_data(), weighted ? weights.typed_data() : nullptr};
  p.write = RecordPeers(in);
  p.read = [=, dest = dest.typed_data(), row_pos = row_pos.typed_data(),
            out = static_cast<char*>(out->untyped_data())]() {
    std::vector<const char*> ys(in->peers.size());
    std::vector<const float*> ws(in->peers.size());
    for (size_t r = 0; r < in->peers.size(); ++r) {
      ys[r] = static_cast<const char*>(in->peers[r][0]);
      ws[r] = static_cast<const float*>(in->peers[r][1]);
    }
    PullCombine(shape, dtype.value(), ys.data(), weighted ? ws.data() : nullptr, dest, row_pos,
                out);
    return Status::Ok();
  };
  return Exchange("combine", call, std::move(p));
}

// Returns one float per row to the (t, k) it came from (the routing-weight gradient).
ffi::Future ReturnRowValuesImpl(ffi::RunId run_id, ffi::Buffer<ffi::F32> values,
                                ffi::Buffer<ffi::S32> row_pos, ffi::Buffer<ffi::S32> dest,
                                ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                                ExchangeAttrs exchange, ffi::ResultBuffer<ffi::F32> out) {
  const CallSite call = MakeCallSite(run_id, rank, group, exchange);
  const int64_t T = out->dimensions()[0], K = out->dimensions()[1];
  const ExchangeShape shape{call.num_ranks, T, K, values.dimensions()[0], 0};
  auto in = std::make_shared<PeerInputs>();
  Participant p;
  p.published = {values.typed_data()};
  p.write = RecordPeers(in);
  p.read = [=, dest = dest.typed_data(), row_pos = row_pos.typed_data(),
            out = out->typed_data()]() {
    std::vector<const float*> vs(in->peers.size());
    for (size_t r = 0; r < in->peers.size(); ++r) {
      vs[r] = static_cast<const float*>(in->peers[r][0]);
    }
    PullRowValues(shape, vs.data(), dest, row_pos, out);
    return Status::Ok();
  };
  return Exchange("row values", call, std::move(p));
}

// FP8 on the wire: each token of x [T, H] into its wire row (xla_ffi/common/fp8.h), at the source.
ffi::Error Fp8QuantizeImpl(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::U8>> wire) {
  auto dtype = ToDtype(x.element_type(), "x");
  if (dtype.has_error()) return dtype.error();
  const int64_t tokens = x.dimensions()[0], hidden = x.dimensions()[1];
  if (wire->dimensions()[0] != tokens || wire->dimensions()[1] != Fp8WireBytes(hidden)) {
    return ffi::Error::InvalidArgument("jax_hybridep: fp8_quantize needs wire [T, H + 4 * nb]");
  }
  const int64_t row_bytes = hidden * DtypeBytes(dtype.value());
  for (int64_t t = 0; t < tokens; ++t) {
    QuantizeRow(static_cast<const char*>(x.untyped_data()) + t * row_bytes, hidden, dtype.value(),
                wire->typed_data() + t * Fp8WireBytes(hidden));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kFp8Quantize, Fp8QuantizeImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()          // x [T, H]
                           .Ret<ffi::Buffer<ffi::U8>>());  // wire [T, H + 4 * ceil(H / 128)]

XLA_FFI_DEFINE_HANDLER(kLayout, LayoutImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Arg<ffi::Buffer<ffi::S32>>()  // topk_idx [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attrs<LayoutExchangeAttrs>()
                           .Ret<ffi::Buffer<ffi::S32>>()    // row_pos [T, K]
                           .Ret<ffi::Buffer<ffi::S32>>()    // group_sizes [E_local]
                           .Ret<ffi::Buffer<ffi::S32>>()    // tokens_per_expert [E]
                           .Ret<ffi::Buffer<ffi::S32>>()    // dropped []
                           .Ret<ffi::Buffer<ffi::S32>>());  // invalid []

XLA_FFI_DEFINE_HANDLER(kLayoutGathered, LayoutGatheredImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::S32>>()  // topk_idx [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // gathered counts [R, E + 1]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attrs<LayoutAttrsView>()
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
                           .Attrs<RowExchangeAttrs>()
                           .Ret<ffi::AnyBuffer>()           // tokens [C, H]
                           .Ret<ffi::Buffer<ffi::F32>>());  // row_weights [C]

XLA_FFI_DEFINE_HANDLER(kCombineVjp, CombineVjpImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Arg<ffi::AnyBuffer>()         // g [T, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // scale [C]
                           .Arg<ffi::AnyBuffer>()         // y [C, H]
                           .Arg<ffi::Buffer<ffi::S32>>()  // row_pos [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attrs<RowExchangeAttrs>()
                           .Ret<ffi::AnyBuffer>()           // scaled [C, H]
                           .Ret<ffi::Buffer<ffi::F32>>());  // dot [C]

XLA_FFI_DEFINE_HANDLER(kCombine, CombineImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Arg<ffi::AnyBuffer>()         // y [C, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // row_pos [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attrs<CombineAttrs>()
                           .Ret<ffi::AnyBuffer>());  // out [T, H]

XLA_FFI_DEFINE_HANDLER(kReturnRowValues, ReturnRowValuesImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Arg<ffi::Buffer<ffi::F32>>()  // values [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // row_pos [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attrs<ExchangeAttrs>()
                           .Ret<ffi::Buffer<ffi::F32>>());  // out [T, K]

std::vector<HandlerEntry> CpuHandlers() {
  std::vector<HandlerEntry> handlers = {
      {"jax_hybridep_layout", kLayout},
      {"jax_hybridep_layout_gathered", kLayoutGathered},
      {"jax_hybridep_dispatch", kDispatch},
      {"jax_hybridep_combine_vjp", kCombineVjp},
      {"jax_hybridep_combine", kCombine},
      {"jax_hybridep_return_row_values", kReturnRowValues},
      {"jax_hybridep_fp8_quantize", kFp8Quantize},
  };
  for (const HandlerEntry& entry : CpuLevelHandlers()) handlers.push_back(entry);
  return handlers;
}

}  // namespace jax_hybridep
