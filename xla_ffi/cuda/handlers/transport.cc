// XLA FFI handlers (platform CUDA) of the GPU transport (kernels/transport.h), issued by
// jax_hybridep/exchange/cuda.py (docs/design.md §2.1 is the contract):
//   cuda_slot_map       gathered routing -> send slots, the receiver's row map, row weights (local)
//   cuda_dispatch       send (num_sms blocks) + permute (wide); FP8 quantised/dequantised on the
//                       way
//   cuda_redispatch(_scaled)  the same along an existing slot map (combine's VJP)
//   cuda_unpermute      each received item's rows summed in ascending k (local, wide)
//   cuda_combine        the partials sent back (num_sms blocks, at most 8) + reduce (wide)
// The exchanges keep, per call site and device (state/site_state.h, owned by the executable),
// the rank and group (read from their operands on the first execution) and the site's window
// (state/window_registry.h). Exchange numbers are not counted by the handlers: the kernels read
// them from the window.
#include "xla_ffi/cuda/kernels/transport.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_support.h"
#include "xla_ffi/common/fp8.h"
#include "xla_ffi/cuda/handlers/attrs.h"
#include "xla_ffi/cuda/handlers/registry.h"
#include "xla_ffi/cuda/handlers/support.h"
#include "xla_ffi/cuda/kernels/slot_map.h"
#include "xla_ffi/cuda/state/site_state.h"
#include "xla_ffi/cuda/state/window_registry.h"

namespace jax_hybridep {
namespace ffi = xla::ffi;
namespace {

// One exchange's kernel parameters: the window (acquired on the site's first exchange), its
// regions and every peer's base.
struct Begun {
  ExchangeParams ex;
  PeerWindows peers;
};

ffi::ErrorOr<Begun> BeginExchange(cudaStream_t stream, int32_t device, SiteState* state,
                                  ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                                  const TransportAttrs& attrs, int64_t items, int64_t row_bytes) {
  if (attrs.num_sms < 1 || attrs.num_sms > kMaxSendBlocks) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("jax_hybridep: num_sms must be in [1, " +
                                                       std::to_string(kMaxSendBlocks) + "], got " +
                                                       std::to_string(attrs.num_sms)));
  }
  auto site_or = state->OnDevice(device, stream, rank, group);
  if (site_or.has_error()) return ffi::Unexpected(site_or.error());
  DeviceSite& site = *site_or.value();
  // A site's exchanges all move rows of one size, so its one window is the window of that size.
  const WindowGeometry geometry{attrs.num_ranks, items, row_bytes};
  if (site.window == nullptr) {
    const WindowKey key{site.group, geometry, attrs.multi_process};
    const Status s = AcquireWindow(key, site.rank, device,
                                   std::chrono::milliseconds(attrs.timeout_ms), &site.window);
    if (!s.ok()) {
      site.window = nullptr;
      return ffi::Unexpected(ToError(s));
    }
  }
  RankWindow* view = site.window;
  if (Status s = WindowError(*view); !s.ok()) return ffi::Unexpected(ToError(s));
  Begun b{};
  b.ex.window = WindowRegionsFor(geometry);
  b.ex.own = view->bases[site.rank];
  b.ex.ranks = static_cast<int32_t>(attrs.num_ranks);
  b.ex.rank = site.rank;
  b.ex.items = items;
  b.ex.row_bytes = row_bytes;
  b.ex.send_blocks = static_cast<int32_t>(attrs.num_sms);
  // Across processes each process counts its own call sites (a trace on one process alone moves
  // its count): the tag then carries no site, only the exchange number is compared.
  b.ex.site = attrs.multi_process ? 0u : static_cast<uint32_t>(attrs.site);
  b.ex.timeout_ns = attrs.timeout_ms * 1000000;
  b.ex.error = view->error_device;
  for (int64_t r = 0; r < attrs.num_ranks; ++r) b.peers.base[r] = view->bases[r];
  return b;
}

int64_t RowBytes(ffi::AnyBuffer rows) {
  const int64_t n = rows.dimensions()[0];
  return n == 0 ? 0 : static_cast<int64_t>(rows.size_bytes()) / n;
}

// One side of an FP8 dispatch (fp8_hidden = H > 0): uint8 wire rows [n, Fp8WireBytes(H)] moved as
// bytes, or rows [n, H] of a float dtype the transport quantises (x) or dequantises into (rows).
struct Fp8Side {
  bool converted;
  Dtype dtype;
};

ffi::ErrorOr<Fp8Side> CheckFp8Side(ffi::DataType type, ffi::Span<const int64_t> dims,
                                   int64_t hidden, const char* what) {
  const bool wire = type == ffi::DataType::U8;
  const int64_t want = wire ? Fp8WireBytes(hidden) : hidden;
  if (dims.size() != 2 || dims[1] != want) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string("jax_hybridep: FP8 dispatch with H=") + std::to_string(hidden) + " needs " +
        what + " as [n, " + std::to_string(want) + "] (" +
        (wire ? "uint8 wire rows" : "rows of a float dtype") + ")"));
  }
  if (wire) return Fp8Side{false, Dtype::kF32};
  auto dtype = ToDtype(type, what);
  if (dtype.has_error()) return ffi::Unexpected(dtype.error());
  return Fp8Side{true, dtype.value()};
}

// What a launch after the send would refuse is checked before the send: a send whose flags are
// raised in the peers' windows, with no receive after it, leaves them one exchange ahead.
ffi::Error CheckBeforeSend(int64_t k, int64_t out_row_bytes, int64_t want_row_bytes,
                           const char* what) {
  if (k < 1 || k > kMaxTopK) {
    return ffi::Error::InvalidArgument("jax_hybridep: " + std::string(what) +
                                       ": K=" + std::to_string(k) + " must be in [1, " +
                                       std::to_string(kMaxTopK) + "]");
  }
  if (out_row_bytes != want_row_bytes) {
    return ffi::Error::InvalidArgument(
        "jax_hybridep: " + std::string(what) + ": output rows of " + std::to_string(out_row_bytes) +
        " bytes, the exchange moves rows of " + std::to_string(want_row_bytes));
  }
  return ffi::Error::Success();
}

PaddingFill Fill(int64_t rows, const RowsAttrs& attrs) {
  return PaddingFill{rows, attrs.sparse_pad_multiple};
}

// ----------------------------------------------------------------------------- slot map

ffi::Error SlotMapImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> gathered,
                       ffi::Buffer<ffi::S32> coord, ffi::ResultBuffer<ffi::S32> send_slot,
                       ffi::ResultBuffer<ffi::S32> recv_item, ffi::ResultBuffer<ffi::S32> recv_rows,
                       ffi::ResultBuffer<ffi::F32> row_weights,
                       ffi::ResultBuffer<ffi::S32> row_slot, ffi::ResultBuffer<ffi::S32> info,
                       ffi::ResultBuffer<ffi::S32> workspace) {
  const auto dims = gathered.dimensions();
  if (dims.size() != 4 || dims[3] != 3) {
    return ffi::Error::InvalidArgument("jax_hybridep: gathered routing must be [S, M, K, 3]");
  }
  const SlotMapShape shape{dims[0], dims[1], dims[2], row_weights->dimensions()[0]};
  if (static_cast<size_t>(workspace->size_bytes()) < SlotMapWorkspaceBytes(shape)) {
    return ffi::Error::InvalidArgument("jax_hybridep: the slot map's workspace is too small");
  }
  return Launched(
      LaunchSlotMap(shape, coord.typed_data(), gathered.typed_data(), send_slot->typed_data(),
                    recv_item->typed_data(), recv_rows->typed_data(), row_weights->typed_data(),
                    row_slot->typed_data(), info->typed_data(), workspace->untyped_data(), stream),
      "slot map");
}

// ----------------------------------------------------------------------------- dispatch

ffi::Error DispatchImpl(cudaStream_t stream, int32_t device, SiteState* state, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> send_slot, ffi::Buffer<ffi::S32> recv_rows,
                        ffi::Buffer<ffi::S32> row_slot, ffi::Buffer<ffi::S32> info,
                        ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                        DispatchAttrs attrs, ffi::Result<ffi::AnyBuffer> tokens) {
  const int64_t hidden = attrs.fp8_hidden;
  Fp8Side send{false, Dtype::kF32}, receive{false, Dtype::kF32};
  if (hidden > 0) {
    auto x_side = CheckFp8Side(x.element_type(), x.dimensions(), hidden, "x");
    if (x_side.has_error()) return x_side.error();
    auto out_side = CheckFp8Side(tokens->element_type(), tokens->dimensions(), hidden, "the rows");
    if (out_side.has_error()) return out_side.error();
    send = x_side.value();
    receive = out_side.value();
  } else if (auto dtype = ToDtype(x.element_type(), "x"); dtype.has_error()) {
    return dtype.error();
  }
  const int64_t M = x.dimensions()[0], K = recv_rows.dimensions()[1];
  const int64_t row_bytes = hidden > 0 ? Fp8WireBytes(hidden) : RowBytes(x);
  const int64_t out_row_bytes = RowBytes(*tokens);
  const int64_t want_out = receive.converted ? hidden * DtypeBytes(receive.dtype) : row_bytes;
  const bool empty = M == 0 || tokens->dimensions()[0] == 0;  // no row to compare
  if (auto e = CheckBeforeSend(K, empty ? want_out : out_row_bytes, want_out, "dispatch");
      e.failure()) {
    return e;
  }
  auto begun = BeginExchange(stream, device, state, rank, group, attrs, M, row_bytes);
  if (begun.has_error()) return begun.error();
  const Begun& b = begun.value();
  cudaError_t s =
      LaunchSendRows(b.ex, b.peers, static_cast<const char*>(x.untyped_data()), RowBytes(x),
                     send_slot.typed_data(), send.dtype, send.converted ? hidden : 0, stream);
  if (s == cudaSuccess) {
    s = LaunchPermute(b.ex, K, recv_rows.typed_data(), row_slot.typed_data(), info.typed_data(),
                      Fill(tokens->dimensions()[0], attrs),
                      static_cast<char*>(tokens->untyped_data()), RowBytes(*tokens), receive.dtype,
                      receive.converted ? hidden : 0, stream);
  }
  return Launched(s, "dispatch");
}

// Combine's VJP: g [M, H] along the dispatch's layout into rows; with `scale`, also rows * scale.
ffi::Error Redispatch(cudaStream_t stream, int32_t device, SiteState* state, ffi::AnyBuffer g,
                      const float* scale, ffi::Buffer<ffi::S32> send_slot,
                      ffi::Buffer<ffi::S32> recv_rows, ffi::Buffer<ffi::S32> row_slot,
                      ffi::Buffer<ffi::S32> info, ffi::Buffer<ffi::S32> rank,
                      ffi::Buffer<ffi::S32> group, const RowsAttrs& attrs,
                      ffi::Span<const int64_t> out_dims, char* rows, char* scaled) {
  auto dtype = ToDtype(g.element_type(), "g");
  if (dtype.has_error()) return dtype.error();
  const int64_t M = g.dimensions()[0], K = recv_rows.dimensions()[1], row_bytes = RowBytes(g);
  if (auto e = CheckBeforeSend(K, row_bytes, row_bytes, "redispatch"); e.failure()) return e;
  auto begun = BeginExchange(stream, device, state, rank, group, attrs, M, row_bytes);
  if (begun.has_error()) return begun.error();
  const Begun& b = begun.value();
  cudaError_t s = LaunchSendRows(b.ex, b.peers, static_cast<const char*>(g.untyped_data()),
                                 row_bytes, send_slot.typed_data(), Dtype::kF32, 0, stream);
  const PaddingFill fill = Fill(out_dims[0], attrs);
  if (s == cudaSuccess) {
    s = scale == nullptr
            ? LaunchPermute(b.ex, K, recv_rows.typed_data(), row_slot.typed_data(),
                            info.typed_data(), fill, rows, row_bytes, dtype.value(), 0, stream)
            : LaunchPermuteScaled(b.ex, K, dtype.value(), recv_rows.typed_data(),
                                  row_slot.typed_data(), info.typed_data(), fill, scale, rows,
                                  scaled, stream);
  }
  return Launched(s, "redispatch");
}

ffi::Error RedispatchImpl(cudaStream_t stream, int32_t device, SiteState* state, ffi::AnyBuffer g,
                          ffi::Buffer<ffi::S32> send_slot, ffi::Buffer<ffi::S32> recv_rows,
                          ffi::Buffer<ffi::S32> row_slot, ffi::Buffer<ffi::S32> info,
                          ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group, RowsAttrs attrs,
                          ffi::Result<ffi::AnyBuffer> rows) {
  return Redispatch(stream, device, state, g, nullptr, send_slot, recv_rows, row_slot, info, rank,
                    group, attrs, rows->dimensions(), static_cast<char*>(rows->untyped_data()),
                    nullptr);
}

ffi::Error RedispatchScaledImpl(cudaStream_t stream, int32_t device, SiteState* state,
                                ffi::AnyBuffer g, ffi::Buffer<ffi::F32> scale,
                                ffi::Buffer<ffi::S32> send_slot, ffi::Buffer<ffi::S32> recv_rows,
                                ffi::Buffer<ffi::S32> row_slot, ffi::Buffer<ffi::S32> info,
                                ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                                RowsAttrs attrs, ffi::Result<ffi::AnyBuffer> rows,
                                ffi::Result<ffi::AnyBuffer> scaled) {
  return Redispatch(stream, device, state, g, scale.typed_data(), send_slot, recv_rows, row_slot,
                    info, rank, group, attrs, rows->dimensions(),
                    static_cast<char*>(rows->untyped_data()),
                    static_cast<char*>(scaled->untyped_data()));
}

// ----------------------------------------------------------------------------- combine

ffi::Error UnpermuteImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::F32> weights,
                         ffi::Buffer<ffi::S32> recv_rows, ffi::Buffer<ffi::S32> info,
                         UnpermuteAttrs attrs, ffi::Result<ffi::AnyBuffer> partials) {
  auto dtype = ToDtype(y.element_type(), "y");
  if (dtype.has_error()) return dtype.error();
  if (partials->element_type() != y.element_type() || RowBytes(*partials) != RowBytes(y)) {
    return ffi::Error::InvalidArgument("jax_hybridep: partials must be rows of y's type");
  }
  const int64_t hidden = y.dimensions()[1], K = recv_rows.dimensions()[1];
  return Launched(
      LaunchUnpermute(dtype.value(), hidden, K, static_cast<const char*>(y.untyped_data()),
                      attrs.weighted ? weights.typed_data() : nullptr, recv_rows.typed_data(),
                      info.typed_data(), partials->dimensions()[0],
                      static_cast<char*>(partials->untyped_data()), stream),
      "unpermute");
}

ffi::Error CombineImpl(cudaStream_t stream, int32_t device, SiteState* state,
                       ffi::AnyBuffer partials, ffi::Buffer<ffi::S32> recv_item,
                       ffi::Buffer<ffi::S32> info, ffi::Buffer<ffi::S32> dest,
                       ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                       TransportAttrs attrs, ffi::Result<ffi::AnyBuffer> out) {
  auto dtype = ToDtype(partials.element_type(), "the partials");
  if (dtype.has_error()) return dtype.error();
  const int64_t M = out->dimensions()[0], K = dest.dimensions()[1];
  if (out->element_type() != partials.element_type()) {
    return ffi::Error::InvalidArgument(
        "jax_hybridep: combine's output must be of the "
        "partials' type");
  }
  const bool empty = M == 0 || partials.dimensions()[0] == 0;  // no row to compare
  if (auto e = CheckBeforeSend(K, empty ? RowBytes(partials) : RowBytes(*out), RowBytes(partials),
                               "combine");
      e.failure()) {
    return e;
  }
  TransportAttrs capped = attrs;
  capped.num_sms = std::min<int64_t>(attrs.num_sms, kCombineMaxBlocks);
  auto begun = BeginExchange(stream, device, state, rank, group, capped, M, RowBytes(partials));
  if (begun.has_error()) return begun.error();
  const Begun& b = begun.value();
  cudaError_t s =
      LaunchSendPartials(b.ex, b.peers, static_cast<const char*>(partials.untyped_data()),
                         recv_item.typed_data(), info.typed_data(), stream);
  if (s == cudaSuccess) {
    s = LaunchReduce(b.ex, dtype.value(), K, dest.typed_data(),
                     static_cast<char*>(out->untyped_data()), stream);
  }
  return Launched(s, "combine");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kCudaSlotMap, SlotMapImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::Buffer<ffi::S32>>()    // gathered routing [S, M, K, 3]
                           .Arg<ffi::Buffer<ffi::S32>>()    // coord [] (this GPU in the level)
                           .Ret<ffi::Buffer<ffi::S32>>()    // send_slot [Mp, S]
                           .Ret<ffi::Buffer<ffi::S32>>()    // recv_item [Np]
                           .Ret<ffi::Buffer<ffi::S32>>()    // recv_rows [Np, K]
                           .Ret<ffi::Buffer<ffi::F32>>()    // row_weights [C]
                           .Ret<ffi::Buffer<ffi::S32>>()    // row_slot [C]
                           .Ret<ffi::Buffer<ffi::S32>>()    // info [2]
                           .Ret<ffi::Buffer<ffi::S32>>());  // workspace

XLA_FFI_DEFINE_HANDLER(kCudaDispatch, DispatchImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<SiteState>>()
                           .Arg<ffi::AnyBuffer>()         // x [M, H] (or FP8 wire rows)
                           .Arg<ffi::Buffer<ffi::S32>>()  // send_slot [Mp, S]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_rows [Np, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // row_slot [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // info [2]
                           .Arg<ffi::Buffer<ffi::S32>>()  // coord []
                           .Arg<ffi::Buffer<ffi::S32>>()  // level group []
                           .Attrs<DispatchAttrs>()
                           .Ret<ffi::AnyBuffer>());  // tokens [C, H] (or FP8 wire rows)

XLA_FFI_DEFINE_HANDLER(kCudaRedispatch, RedispatchImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<SiteState>>()
                           .Arg<ffi::AnyBuffer>()         // g [M, H]
                           .Arg<ffi::Buffer<ffi::S32>>()  // send_slot [Mp, S]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_rows [Np, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // row_slot [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // info [2]
                           .Arg<ffi::Buffer<ffi::S32>>()  // coord []
                           .Arg<ffi::Buffer<ffi::S32>>()  // level group []
                           .Attrs<RowsAttrs>()
                           .Ret<ffi::AnyBuffer>());  // rows [C, H]

XLA_FFI_DEFINE_HANDLER(kCudaRedispatchScaled, RedispatchScaledImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<SiteState>>()
                           .Arg<ffi::AnyBuffer>()         // g [M, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // scale [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // send_slot [Mp, S]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_rows [Np, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // row_slot [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // info [2]
                           .Arg<ffi::Buffer<ffi::S32>>()  // coord []
                           .Arg<ffi::Buffer<ffi::S32>>()  // level group []
                           .Attrs<RowsAttrs>()
                           .Ret<ffi::AnyBuffer>()    // rows [C, H]
                           .Ret<ffi::AnyBuffer>());  // scaled [C, H]

XLA_FFI_DEFINE_HANDLER(kCudaUnpermute, UnpermuteImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::AnyBuffer>()         // y [C, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_rows [Np, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // info [2]
                           .Attrs<UnpermuteAttrs>()
                           .Ret<ffi::AnyBuffer>());  // partials [Np, H]

XLA_FFI_DEFINE_HANDLER(kCudaCombine, CombineImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<SiteState>>()
                           .Arg<ffi::AnyBuffer>()         // partials [Np, H]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_item [Np]
                           .Arg<ffi::Buffer<ffi::S32>>()  // info [2]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [M, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // coord []
                           .Arg<ffi::Buffer<ffi::S32>>()  // level group []
                           .Attrs<TransportAttrs>()
                           .Ret<ffi::AnyBuffer>());  // out [M, H]

std::vector<HandlerEntry> CudaTransportHandlers() {
  return {
      {"jax_hybridep_cuda_slot_map", kCudaSlotMap},
      {"jax_hybridep_cuda_dispatch", kCudaDispatch},
      {"jax_hybridep_cuda_redispatch", kCudaRedispatch},
      {"jax_hybridep_cuda_redispatch_scaled", kCudaRedispatchScaled},
      {"jax_hybridep_cuda_unpermute", kCudaUnpermute},
      {"jax_hybridep_cuda_combine", kCudaCombine},
  };
}

}  // namespace jax_hybridep
