// XLA FFI handlers (platform CUDA) of the direct-write transport (transport.h): dispatch,
// redispatch (combine's VJP, scaled or not), combine and the row values back (the routing-weight
// gradient), across one level of GPUs: peers in this process through peer access, peers in other
// processes of the node through CUDA IPC (`multi_process`, windows.h). Slower levels are XLA
// collectives around these calls (jax_hybridep/exchange/cuda_bottom.py).
//
// Every handler only enqueues kernels on XLA's stream; nothing waits on the host on the hot path.
// The first execution of each call site on each device reads its rank and group in the level
// (operands from axis_index, one synchronous 8-byte copy) and acquires the registered window;
// later executions reuse both (site_state.h: the executable owns them). Dispatch returns, beside
// the rows, the receiver's map of rows to (source, t, k) (`recv_row_pos`, part of the handle) that
// combine and the VJPs send back along.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda/cuda_attrs.h"
#include "xla_ffi/cuda/cuda_handlers.h"
#include "xla_ffi/cuda/site_state.h"
#include "xla_ffi/cuda/transport.h"
#include "xla_ffi/cuda/windows.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/fp8.h"

namespace jax_hybridep {
namespace ffi = xla::ffi;
namespace {

ffi::Error CudaError(cudaError_t status, const char* what) {
  cudaGetLastError();
  return ffi::Error::Internal(std::string("jax_hybridep: ") + what +
                              " failed: " + cudaGetErrorString(status));
}

// The site's window for rows of `row_bytes`, acquired on its first exchange.
ffi::Error EnsureWindow(DeviceSite& site, int32_t device, int64_t num_ranks, int64_t tokens,
                        int64_t k, int64_t row_bytes, bool multi_process, int64_t timeout_ms) {
  if (site.window == nullptr) {
    const WindowKey key{site.group, WindowGeometry{num_ranks, tokens, k, row_bytes}, multi_process};
    const Status s =
        AcquireWindow(key, site.rank, device, std::chrono::milliseconds(timeout_ms), &site.window);
    if (!s.ok()) return ToError(s);
  }
  return ToError(WindowError(*site.window));
}

ffi::Error Launched(cudaError_t status, const char* what) {
  return status == cudaSuccess ? ffi::Error::Success() : CudaError(status, what);
}

ffi::Error CheckSendBlocks(int64_t send_blocks) {
  if (send_blocks >= 1 && send_blocks <= kMaxSendBlocks) return ffi::Error::Success();
  return ffi::Error::InvalidArgument("jax_hybridep: num_sms must be in [1, " +
                                     std::to_string(kMaxSendBlocks) + "], got " +
                                     std::to_string(send_blocks));
}

// Everything an exchange handler does before its kernels: site, window, context.
ffi::ErrorOr<ExchangeContext> BeginExchange(cudaStream_t stream, int32_t device, SiteState* state,
                                            ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                                            const TransportAttrs& attrs, int64_t tokens, int64_t k,
                                            int64_t row_bytes) {
  if (ffi::Error e = CheckSendBlocks(attrs.num_sms); e.failure()) return ffi::Unexpected(e);
  auto site = state->OnDevice(device, stream, rank, group);
  if (site.has_error()) return ffi::Unexpected(site.error());
  if (ffi::Error e = EnsureWindow(*site.value(), device, attrs.num_ranks, tokens, k, row_bytes,
                                  attrs.multi_process, attrs.timeout_ms);
      e.failure()) {
    return ffi::Unexpected(e);
  }
  // The next exchange on the site's window.
  RankWindow& w = *site.value()->window;
  return ExchangeContext{w.windows,
                         attrs.num_ranks,
                         tokens,
                         k,
                         row_bytes,
                         site.value()->rank,
                         ++w.generation,
                         static_cast<int32_t>(attrs.num_sms),
                         attrs.timeout_ms * 1000000,
                         w.error_device};
}

int64_t RowBytes(ffi::AnyBuffer rows) {
  const int64_t n = rows.dimensions()[0];
  return n == 0 ? 0 : static_cast<int64_t>(rows.size_bytes()) / n;
}

// One side of an FP8 dispatch (fp8_hidden = H > 0): uint8 wire rows [n, Fp8WireBytes(H)] moved as
// bytes, or rows [n, H] of a float dtype the transport quantises (x) or dequantises into (tokens).
struct Fp8Side {
  bool converted;  // a float dtype, quantised or dequantised by the kernels
  Dtype dtype;     // when converted
};

ffi::ErrorOr<Fp8Side> CheckFp8Side(ffi::DataType type, ffi::Span<const int64_t> dims,
                                   int64_t hidden, const char* what) {
  const bool wire = type == ffi::DataType::U8;
  const int64_t want = wire ? Fp8WireBytes(hidden) : hidden;
  if (dims.size() != 2 || dims[1] != want) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string("jax_hybridep: FP8 dispatch with H=") + std::to_string(hidden) + " needs " +
        what + " as [n, " + std::to_string(want) + "] (" +
        (wire ? "uint8 wire rows" : "rows of a float dtype") + "), got [n, " +
        (dims.size() == 2 ? std::to_string(dims[1]) : std::string("?")) + "]"));
  }
  if (wire) return Fp8Side{false, Dtype::kF32};
  auto dtype = ToDtype(type, what);
  if (dtype.has_error()) return ffi::Unexpected(dtype.error());
  return Fp8Side{true, dtype.value()};
}

// Dispatch; with fp8_hidden = H > 0 the windows carry FP8 wire rows (docs/design.md §2.1.8),
// quantised by the send when x is [T, H] of a float dtype and dequantised by the receive when
// tokens is.
ffi::Error DispatchImpl(cudaStream_t stream, int32_t device, SiteState* state, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> row_pos,
                        ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> rank,
                        ffi::Buffer<ffi::S32> group, TransportDispatchAttrs attrs,
                        ffi::Result<ffi::AnyBuffer> tokens, ffi::ResultBuffer<ffi::F32> row_weights,
                        ffi::ResultBuffer<ffi::S32> recv_row_pos) {
  const int64_t fp8_hidden = attrs.fp8_hidden;
  Fp8Side send{false, Dtype::kF32}, receive{false, Dtype::kF32};
  if (fp8_hidden > 0) {
    auto x_side = CheckFp8Side(x.element_type(), x.dimensions(), fp8_hidden, "x");
    if (x_side.has_error()) return x_side.error();
    auto out_side =
        CheckFp8Side(tokens->element_type(), tokens->dimensions(), fp8_hidden, "the rows");
    if (out_side.has_error()) return out_side.error();
    send = x_side.value();
    receive = out_side.value();
  } else if (auto dtype = ToDtype(x.element_type(), "x"); dtype.has_error()) {
    return dtype.error();
  }
  const int64_t T = x.dimensions()[0], K = row_pos.dimensions()[1];
  const int64_t row_bytes = fp8_hidden > 0 ? Fp8WireBytes(fp8_hidden) : RowBytes(x);
  auto ctx = BeginExchange(stream, device, state, rank, group, attrs, T, K, row_bytes);
  if (ctx.has_error()) return ctx.error();
  const char* in = static_cast<const char*>(x.untyped_data());
  char* out = static_cast<char*>(tokens->untyped_data());
  const int64_t rows = tokens->dimensions()[0];
  cudaError_t s =
      send.converted
          ? LaunchSendTokensQuantized(ctx.value(), send.dtype, fp8_hidden, in, dest.typed_data(),
                                      row_pos.typed_data(), weights.typed_data(), stream)
          : LaunchSendTokens(ctx.value(), in, dest.typed_data(), row_pos.typed_data(),
                             weights.typed_data(), stream);
  if (s == cudaSuccess) {
    s = receive.converted ? LaunchReceiveRowsDequantized(ctx.value(), receive.dtype, fp8_hidden,
                                                         out, row_weights->typed_data(),
                                                         recv_row_pos->typed_data(), rows, stream)
                          : LaunchReceiveRows(ctx.value(), out, row_weights->typed_data(),
                                              recv_row_pos->typed_data(), rows, stream);
  }
  return Launched(s, "dispatch");
}

// Combine's VJP: g [T, H] along the dispatch's layout into rows, and with `scale` the rows times
// scale[row] (rounded to g's dtype) in the same pass.
ffi::Error Redispatch(cudaStream_t stream, int32_t device, SiteState* state, ffi::AnyBuffer g,
                      const float* scale, ffi::Buffer<ffi::S32> dest,
                      ffi::Buffer<ffi::S32> recv_row_pos, ffi::Buffer<ffi::S32> rank,
                      ffi::Buffer<ffi::S32> group, const TransportAttrs& attrs, int64_t num_rows,
                      char* rows, char* scaled) {
  auto dtype = ToDtype(g.element_type(), "g");
  if (dtype.has_error()) return dtype.error();
  const int64_t T = g.dimensions()[0], K = dest.dimensions()[1], row_bytes = RowBytes(g);
  auto ctx = BeginExchange(stream, device, state, rank, group, attrs, T, K, row_bytes);
  if (ctx.has_error()) return ctx.error();
  cudaError_t s =
      LaunchPrefillRedispatch(num_rows, row_bytes, dtype.value(), scale, rows, scaled, stream);
  if (s == cudaSuccess) {
    s = LaunchSendTokens(ctx.value(), static_cast<const char*>(g.untyped_data()), dest.typed_data(),
                         nullptr, nullptr, stream);
  }
  if (s == cudaSuccess) {
    s = LaunchReceiveRedispatch(ctx.value(), dtype.value(), recv_row_pos.typed_data(), scale, rows,
                                scaled, stream);
  }
  return Launched(s, "redispatch");
}

ffi::Error RedispatchImpl(cudaStream_t stream, int32_t device, SiteState* state, ffi::AnyBuffer g,
                          ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> recv_row_pos,
                          ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                          TransportAttrs attrs, ffi::Result<ffi::AnyBuffer> rows) {
  return Redispatch(stream, device, state, g, nullptr, dest, recv_row_pos, rank, group, attrs,
                    rows->dimensions()[0], static_cast<char*>(rows->untyped_data()), nullptr);
}

ffi::Error RedispatchScaledImpl(cudaStream_t stream, int32_t device, SiteState* state,
                                ffi::AnyBuffer g, ffi::Buffer<ffi::F32> scale,
                                ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> recv_row_pos,
                                ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                                TransportAttrs attrs, ffi::Result<ffi::AnyBuffer> rows,
                                ffi::Result<ffi::AnyBuffer> scaled) {
  return Redispatch(stream, device, state, g, scale.typed_data(), dest, recv_row_pos, rank, group,
                    attrs, rows->dimensions()[0], static_cast<char*>(rows->untyped_data()),
                    static_cast<char*>(scaled->untyped_data()));
}

ffi::Error CombineImpl(cudaStream_t stream, int32_t device, SiteState* state, ffi::AnyBuffer y,
                       ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> dest,
                       ffi::Buffer<ffi::S32> recv_row_pos, ffi::Buffer<ffi::S32> rank,
                       ffi::Buffer<ffi::S32> group, TransportCombineAttrs attrs,
                       ffi::Result<ffi::AnyBuffer> out) {
  auto dtype = ToDtype(y.element_type(), "y");
  if (dtype.has_error()) return dtype.error();
  const int64_t T = out->dimensions()[0], K = dest.dimensions()[1];
  auto ctx = BeginExchange(stream, device, state, rank, group, attrs, T, K, RowBytes(y));
  if (ctx.has_error()) return ctx.error();
  cudaError_t s = LaunchSendPartials(
      ctx.value(), dtype.value(), static_cast<const char*>(y.untyped_data()),
      attrs.weighted ? weights.typed_data() : nullptr, recv_row_pos.typed_data(), stream);
  if (s == cudaSuccess) {
    s = LaunchReducePartials(ctx.value(), dtype.value(), dest.typed_data(),
                             static_cast<char*>(out->untyped_data()), stream);
  }
  return Launched(s, "combine");
}

ffi::Error ReturnRowValuesImpl(cudaStream_t stream, int32_t device, SiteState* state,
                               ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> dest,
                               ffi::Buffer<ffi::S32> recv_row_pos, ffi::Buffer<ffi::S32> rank,
                               ffi::Buffer<ffi::S32> group, TransportAttrs attrs,
                               ffi::ResultBuffer<ffi::F32> out) {
  const int64_t T = out->dimensions()[0], K = out->dimensions()[1];
  auto ctx = BeginExchange(stream, device, state, rank, group, attrs, T, K, 0);
  if (ctx.has_error()) return ctx.error();
  cudaError_t s =
      LaunchSendRowValues(ctx.value(), values.typed_data(), recv_row_pos.typed_data(), stream);
  if (s == cudaSuccess) {
    s = LaunchReceiveRowValues(ctx.value(), dest.typed_data(), out->typed_data(), stream);
  }
  return Launched(s, "row values");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kCudaDispatch, DispatchImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<SiteState>>()
                           .Arg<ffi::AnyBuffer>()         // x [T, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // row_pos [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attrs<TransportDispatchAttrs>()
                           .Ret<ffi::AnyBuffer>()           // tokens [C, H] (or wire rows)
                           .Ret<ffi::Buffer<ffi::F32>>()    // row_weights [C]
                           .Ret<ffi::Buffer<ffi::S32>>());  // recv_row_pos [R * T, K]

XLA_FFI_DEFINE_HANDLER(kCudaRedispatch, RedispatchImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<SiteState>>()
                           .Arg<ffi::AnyBuffer>()         // g [T, H]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_row_pos [R * T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attrs<TransportAttrs>()
                           .Ret<ffi::AnyBuffer>());  // rows [C, H]

XLA_FFI_DEFINE_HANDLER(kCudaRedispatchScaled, RedispatchScaledImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<SiteState>>()
                           .Arg<ffi::AnyBuffer>()         // g [T, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // scale [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_row_pos [R * T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attrs<TransportAttrs>()
                           .Ret<ffi::AnyBuffer>()    // rows [C, H]
                           .Ret<ffi::AnyBuffer>());  // scaled [C, H]

XLA_FFI_DEFINE_HANDLER(kCudaCombine, CombineImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<SiteState>>()
                           .Arg<ffi::AnyBuffer>()         // y [C, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_row_pos [R * T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attrs<TransportCombineAttrs>()
                           .Ret<ffi::AnyBuffer>());  // out [T, H]

XLA_FFI_DEFINE_HANDLER(kCudaReturnRowValues, ReturnRowValuesImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<SiteState>>()
                           .Arg<ffi::Buffer<ffi::F32>>()  // values [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_row_pos [R * T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attrs<TransportAttrs>()
                           .Ret<ffi::Buffer<ffi::F32>>());  // out [T, K]

std::vector<HandlerEntry> CudaTransportHandlers() {
  return {
      {"jax_hybridep_cuda_dispatch", kCudaDispatch},
      {"jax_hybridep_cuda_redispatch", kCudaRedispatch},
      {"jax_hybridep_cuda_redispatch_scaled", kCudaRedispatchScaled},
      {"jax_hybridep_cuda_combine", kCudaCombine},
      {"jax_hybridep_cuda_return_row_values", kCudaReturnRowValues},
  };
}

}  // namespace jax_hybridep
