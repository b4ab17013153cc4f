// XLA FFI handlers (platform CUDA): layout, and dispatch/combine over the direct-write transport
// (transport.h) across one level of GPUs: peers in this process through peer access, peers in
// other processes of the node through CUDA IPC (`multi_process`, windows.h). Slower levels are
// XLA collectives around these calls (jax_hybridep/backends/ffi_gpu.py).
//
// Every handler only enqueues kernels on XLA's stream; nothing waits on the host on the hot path.
// The first call of each call site on each device reads its rank and group in the level
// (operands from axis_index, one synchronous 8-byte copy) and acquires the registered window
// (windows.h); later calls reuse both. Dispatch returns, beside the rows, the receiver's map of
// rows to (source, t, k) (`recv_row_pos`, part of the handle) that combine and the VJPs send back
// along.
#include "xla_ffi/cuda/cuda_handlers.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda/kernels.h"
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

// Device memory owned by one call site on one device, freed with it (never while in use: a site's
// calls are ordered on its stream and sites live as long as the process).
class DeviceScratch {
 public:
  DeviceScratch() = default;
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <typename T>
  cudaError_t Allocate(size_t n, T** out) {
    void* p = nullptr;
    const cudaError_t s = cudaMalloc(&p, std::max<size_t>(n * sizeof(T), 1));
    if (s != cudaSuccess) return s;
    blocks_.push_back(p);
    *out = static_cast<T*>(p);
    return cudaSuccess;
  }

 private:
  std::vector<void*> blocks_;
};

// What one call site keeps per device.
struct SiteState {
  int32_t rank = 0, group = 0;
  RankWindow* window = nullptr;  // exchanges
  // Layout: the placement on the device and the scratch of its steps.
  int64_t *expert_rank = nullptr, *expert_slot = nullptr;
  int32_t *all_counts = nullptr, *keep_limit = nullptr, *group_offset = nullptr;
  int32_t* all_group_sizes = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  DeviceScratch scratch;
};

std::mutex sites_mu;
std::map<std::pair<int64_t, int32_t>, std::unique_ptr<SiteState>>& Sites() {
  static auto* sites = new std::map<std::pair<int64_t, int32_t>, std::unique_ptr<SiteState>>();
  return *sites;
}

// The state of (site, device), created on first use with this shard's rank and group read from
// their operands (a synchronous copy, once per site and device). The copy waits for this rank's
// earlier exchanges, which may wait for peers at their own first calls: no lock is held meanwhile.
ffi::ErrorOr<SiteState*> Site(int64_t site, int32_t device, cudaStream_t stream,
                              ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group) {
  {
    std::lock_guard<std::mutex> lock(sites_mu);
    auto it = Sites().find({site, device});
    if (it != Sites().end()) return it->second.get();
  }
  int32_t ids[2];
  cudaError_t s = cudaSetDevice(device);  // The site's scratch and window live on this device.
  if (s == cudaSuccess) {
    s = cudaMemcpyAsync(&ids[0], rank.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToHost,
                        stream);
  }
  if (s == cudaSuccess) {
    s = cudaMemcpyAsync(&ids[1], group.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToHost,
                        stream);
  }
  if (s == cudaSuccess) s = cudaStreamSynchronize(stream);
  if (s != cudaSuccess) return ffi::Unexpected(CudaError(s, "reading the EP rank"));
  std::lock_guard<std::mutex> lock(sites_mu);
  std::unique_ptr<SiteState>& state = Sites()[{site, device}];
  if (!state) {  // Calls of one site on one device are sequential; this is the first.
    state = std::make_unique<SiteState>();
    state->rank = ids[0];
    state->group = ids[1];
  }
  return state.get();
}

// The site's window for rows of `row_bytes`, acquired on its first exchange.
ffi::Error EnsureWindow(SiteState& site, int32_t device, int64_t num_ranks, int64_t tokens,
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
ffi::ErrorOr<ExchangeContext> BeginExchange(cudaStream_t stream, int32_t device,
                                            ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                                            int64_t site_id, int64_t num_ranks, int64_t tokens,
                                            int64_t k, int64_t row_bytes, int64_t send_blocks,
                                            bool multi_process, int64_t timeout_ms) {
  if (ffi::Error e = CheckSendBlocks(send_blocks); e.failure()) return ffi::Unexpected(e);
  auto site = Site(site_id, device, stream, rank, group);
  if (site.has_error()) return ffi::Unexpected(site.error());
  if (ffi::Error e = EnsureWindow(*site.value(), device, num_ranks, tokens, k, row_bytes,
                                  multi_process, timeout_ms);
      e.failure()) {
    return ffi::Unexpected(e);
  }
  // The next exchange on the site's window.
  RankWindow& w = *site.value()->window;
  return ExchangeContext{w.windows,
                         num_ranks,
                         tokens,
                         k,
                         row_bytes,
                         site.value()->rank,
                         ++w.generation,
                         static_cast<int32_t>(send_blocks),
                         timeout_ms * 1000000,
                         w.error_device};
}

// ----------------------------------------------------------------------------- layout

// Layout from the counts all-gathered by an XLA collective [R, E + 1]: plan groups and assign
// rows with the CUDA layout kernels (kernels.h), no host sync (strict mode syncs to raise).
ffi::Error LayoutImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> topk_idx,
                      ffi::Buffer<ffi::S32> gathered, ffi::Buffer<ffi::S32> rank,
                      ffi::Buffer<ffi::S32> group, int64_t site_id, int64_t num_ranks,
                      int64_t num_slots, int64_t capacity, int64_t rows, int64_t pad_multiple,
                      ffi::Span<const int64_t> expert_rank, ffi::Span<const int64_t> expert_slot,
                      bool strict, ffi::ResultBuffer<ffi::S32> row_pos,
                      ffi::ResultBuffer<ffi::S32> group_sizes,
                      ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                      ffi::ResultBuffer<ffi::S64> dropped, ffi::ResultBuffer<ffi::S32> invalid) {
  auto site_or = Site(site_id, device, stream, rank, group);
  if (site_or.has_error()) return site_or.error();
  SiteState& site = *site_or.value();
  const int64_t T = topk_idx.dimensions()[0], K = topk_idx.dimensions()[1];
  const int64_t E = static_cast<int64_t>(expert_rank.size());
  cudaError_t s = cudaSuccess;
  if (site.expert_rank == nullptr) {  // First call: placement on the device, scratch.
    DeviceScratch& d = site.scratch;
    site.workspace_bytes = AssignRowsWorkspaceBytes(T, K, E);
    char* workspace = nullptr;
    for (cudaError_t a : {d.Allocate(E, &site.expert_rank), d.Allocate(E, &site.expert_slot),
                          d.Allocate(num_ranks * E, &site.all_counts),
                          d.Allocate(E, &site.keep_limit), d.Allocate(E, &site.group_offset),
                          d.Allocate(num_ranks * num_slots, &site.all_group_sizes),
                          d.Allocate(site.workspace_bytes, &workspace)}) {
      if (a != cudaSuccess) return CudaError(a, "cudaMalloc (layout scratch)");
    }
    site.workspace = workspace;
    // On this call's stream (the attribute spans outlive it): a synchronous copy on the legacy
    // stream could wait for other streams' exchanges, which may wait for peers.
    s = cudaMemcpyAsync(site.expert_rank, expert_rank.begin(), E * sizeof(int64_t),
                        cudaMemcpyHostToDevice, stream);
    if (s == cudaSuccess) {
      s = cudaMemcpyAsync(site.expert_slot, expert_slot.begin(), E * sizeof(int64_t),
                          cudaMemcpyHostToDevice, stream);
    }
    if (s != cudaSuccess) return CudaError(s, "copying the placement");
  }
  // all_counts [R, E] and this rank's invalid count out of gathered [R, E + 1].
  s = cudaMemcpy2DAsync(site.all_counts, E * sizeof(int32_t), gathered.typed_data(),
                        (E + 1) * sizeof(int32_t), E * sizeof(int32_t), num_ranks,
                        cudaMemcpyDeviceToDevice, stream);
  if (s == cudaSuccess) {
    s = cudaMemcpyAsync(invalid->typed_data(), gathered.typed_data() + site.rank * (E + 1) + E,
                        sizeof(int32_t), cudaMemcpyDeviceToDevice, stream);
  }
  const Placement placement{site.expert_rank, site.expert_slot, E, num_ranks, num_slots};
  if (s == cudaSuccess) {
    s = LaunchPlanGroups(site.all_counts, placement, CapacityPlan{capacity, rows, pad_multiple},
                         site.keep_limit, site.group_offset, site.all_group_sizes,
                         tokens_per_expert->typed_data(), stream);
  }
  if (s == cudaSuccess) {
    s = LaunchAssignRows(topk_idx.typed_data(), T, K, site.rank, site.all_counts, placement,
                         site.keep_limit, site.group_offset, row_pos->typed_data(),
                         dropped->typed_data(), site.workspace, site.workspace_bytes, stream);
  }
  if (s == cudaSuccess) {
    s = cudaMemcpyAsync(group_sizes->typed_data(), site.all_group_sizes + site.rank * num_slots,
                        num_slots * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream);
  }
  if (s != cudaSuccess) return CudaError(s, "layout");
  if (!strict) return ffi::Error::Success();
  // Strict mode is a debugging aid: it waits for the counts to fail on every rank at once.
  std::vector<int32_t> host(num_ranks * (E + 1));
  s = cudaMemcpyAsync(host.data(), gathered.typed_data(), host.size() * sizeof(int32_t),
                      cudaMemcpyDeviceToHost, stream);
  if (s == cudaSuccess) s = cudaStreamSynchronize(stream);
  if (s != cudaSuccess) return CudaError(s, "strict-mode check");
  const LayoutAttrs attrs = MakeLayoutAttrs(num_ranks, num_slots, capacity, rows, pad_multiple,
                                            expert_rank, expert_slot, strict);
  return ToError(StrictCheck(attrs, PlanGroup(attrs, host.data()), site.group));
}

// ----------------------------------------------------------------------------- exchanges

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
ffi::Error DispatchImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> row_pos,
                        ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> rank,
                        ffi::Buffer<ffi::S32> group, int64_t site, int64_t num_ranks,
                        int64_t timeout_ms, int64_t num_sms, bool multi_process, int64_t fp8_hidden,
                        ffi::Result<ffi::AnyBuffer> tokens, ffi::ResultBuffer<ffi::F32> row_weights,
                        ffi::ResultBuffer<ffi::S32> recv_row_pos) {
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
  auto ctx = BeginExchange(stream, device, rank, group, site, num_ranks, T, K, row_bytes, num_sms,
                           multi_process, timeout_ms);
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
ffi::Error Redispatch(cudaStream_t stream, int32_t device, ffi::AnyBuffer g, const float* scale,
                      ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> recv_row_pos,
                      ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group, int64_t site,
                      int64_t num_ranks, int64_t timeout_ms, int64_t num_sms, bool multi_process,
                      int64_t num_rows, char* rows, char* scaled) {
  auto dtype = ToDtype(g.element_type(), "g");
  if (dtype.has_error()) return dtype.error();
  const int64_t T = g.dimensions()[0], K = dest.dimensions()[1], row_bytes = RowBytes(g);
  auto ctx = BeginExchange(stream, device, rank, group, site, num_ranks, T, K, row_bytes, num_sms,
                           multi_process, timeout_ms);
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

ffi::Error RedispatchImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer g,
                          ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> recv_row_pos,
                          ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group, int64_t site,
                          int64_t num_ranks, int64_t timeout_ms, int64_t num_sms,
                          bool multi_process, ffi::Result<ffi::AnyBuffer> rows) {
  return Redispatch(stream, device, g, nullptr, dest, recv_row_pos, rank, group, site, num_ranks,
                    timeout_ms, num_sms, multi_process, rows->dimensions()[0],
                    static_cast<char*>(rows->untyped_data()), nullptr);
}

ffi::Error RedispatchScaledImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer g,
                                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> dest,
                                ffi::Buffer<ffi::S32> recv_row_pos, ffi::Buffer<ffi::S32> rank,
                                ffi::Buffer<ffi::S32> group, int64_t site, int64_t num_ranks,
                                int64_t timeout_ms, int64_t num_sms, bool multi_process,
                                ffi::Result<ffi::AnyBuffer> rows,
                                ffi::Result<ffi::AnyBuffer> scaled) {
  return Redispatch(stream, device, g, scale.typed_data(), dest, recv_row_pos, rank, group, site,
                    num_ranks, timeout_ms, num_sms, multi_process, rows->dimensions()[0],
                    static_cast<char*>(rows->untyped_data()),
                    static_cast<char*>(scaled->untyped_data()));
}

ffi::Error CombineImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y,
                       ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> dest,
                       ffi::Buffer<ffi::S32> recv_row_pos, ffi::Buffer<ffi::S32> rank,
                       ffi::Buffer<ffi::S32> group, int64_t site, int64_t num_ranks, bool weighted,
                       int64_t timeout_ms, int64_t num_sms, bool multi_process,
                       ffi::Result<ffi::AnyBuffer> out) {
  auto dtype = ToDtype(y.element_type(), "y");
  if (dtype.has_error()) return dtype.error();
  const int64_t T = out->dimensions()[0], K = dest.dimensions()[1];
  auto ctx = BeginExchange(stream, device, rank, group, site, num_ranks, T, K, RowBytes(y), num_sms,
                           multi_process, timeout_ms);
  if (ctx.has_error()) return ctx.error();
  cudaError_t s = LaunchSendPartials(
      ctx.value(), dtype.value(), static_cast<const char*>(y.untyped_data()),
      weighted ? weights.typed_data() : nullptr, recv_row_pos.typed_data(), stream);
  if (s == cudaSuccess) {
    s = LaunchReducePartials(ctx.value(), dtype.value(), dest.typed_data(),
                             static_cast<char*>(out->untyped_data()), stream);
  }
  return Launched(s, "combine");
}

ffi::Error ReturnRowValuesImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::F32> values,
                               ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> recv_row_pos,
                               ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                               int64_t site, int64_t num_ranks, int64_t timeout_ms, int64_t num_sms,
                               bool multi_process, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t T = out->dimensions()[0], K = out->dimensions()[1];
  auto ctx = BeginExchange(stream, device, rank, group, site, num_ranks, T, K, 0, num_sms,
                           multi_process, timeout_ms);
  if (ctx.has_error()) return ctx.error();
  cudaError_t s =
      LaunchSendRowValues(ctx.value(), values.typed_data(), recv_row_pos.typed_data(), stream);
  if (s == cudaSuccess) {
    s = LaunchReceiveRowValues(ctx.value(), dest.typed_data(), out->typed_data(), stream);
  }
  return Launched(s, "row values");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kCudaLayout, LayoutImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::Buffer<ffi::S32>>()  // topk_idx [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // gathered counts [R, E + 1]
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
                           .Ret<ffi::Buffer<ffi::S32>>()    // row_pos [T, K]
                           .Ret<ffi::Buffer<ffi::S32>>()    // group_sizes [E_local]
                           .Ret<ffi::Buffer<ffi::S32>>()    // tokens_per_expert [E]
                           .Ret<ffi::Buffer<ffi::S64>>()    // dropped []
                           .Ret<ffi::Buffer<ffi::S32>>());  // invalid []

XLA_FFI_DEFINE_HANDLER(kCudaDispatch, DispatchImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()         // x [T, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // row_pos [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attr<int64_t>("site")
                           .Attr<int64_t>("num_ranks")
                           .Attr<int64_t>("timeout_ms")
                           .Attr<int64_t>("num_sms")
                           .Attr<bool>("multi_process")
                           .Attr<int64_t>("fp8_hidden")     // H: FP8 on the wire; 0: none
                           .Ret<ffi::AnyBuffer>()           // tokens [C, H] (or wire rows)
                           .Ret<ffi::Buffer<ffi::F32>>()    // row_weights [C]
                           .Ret<ffi::Buffer<ffi::S32>>());  // recv_row_pos [R * T, K]

XLA_FFI_DEFINE_HANDLER(kCudaRedispatch, RedispatchImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()         // g [T, H]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_row_pos [R * T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attr<int64_t>("site")
                           .Attr<int64_t>("num_ranks")
                           .Attr<int64_t>("timeout_ms")
                           .Attr<int64_t>("num_sms")
                           .Attr<bool>("multi_process")
                           .Ret<ffi::AnyBuffer>());  // rows [C, H]

XLA_FFI_DEFINE_HANDLER(kCudaRedispatchScaled, RedispatchScaledImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()         // g [T, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // scale [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_row_pos [R * T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attr<int64_t>("site")
                           .Attr<int64_t>("num_ranks")
                           .Attr<int64_t>("timeout_ms")
                           .Attr<int64_t>("num_sms")
                           .Attr<bool>("multi_process")
                           .Ret<ffi::AnyBuffer>()    // rows [C, H]
                           .Ret<ffi::AnyBuffer>());  // scaled [C, H]

XLA_FFI_DEFINE_HANDLER(kCudaCombine, CombineImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()         // y [C, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_row_pos [R * T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attr<int64_t>("site")
                           .Attr<int64_t>("num_ranks")
                           .Attr<bool>("weighted")
                           .Attr<int64_t>("timeout_ms")
                           .Attr<int64_t>("num_sms")
                           .Attr<bool>("multi_process")
                           .Ret<ffi::AnyBuffer>());  // out [T, H]

XLA_FFI_DEFINE_HANDLER(kCudaReturnRowValues, ReturnRowValuesImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::Buffer<ffi::F32>>()  // values [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // recv_row_pos [R * T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attr<int64_t>("site")
                           .Attr<int64_t>("num_ranks")
                           .Attr<int64_t>("timeout_ms")
                           .Attr<int64_t>("num_sms")
                           .Attr<bool>("multi_process")
                           .Ret<ffi::Buffer<ffi::F32>>());  // out [T, K]

std::vector<HandlerEntry> CudaHandlers() {
  return {
      {"jax_hybridep_cuda_layout", kCudaLayout},
      {"jax_hybridep_cuda_dispatch", kCudaDispatch},
      {"jax_hybridep_cuda_redispatch", kCudaRedispatch},
      {"jax_hybridep_cuda_redispatch_scaled", kCudaRedispatchScaled},
      {"jax_hybridep_cuda_combine", kCudaCombine},
      {"jax_hybridep_cuda_return_row_values", kCudaReturnRowValues},
  };
}

}  // namespace jax_hybridep
