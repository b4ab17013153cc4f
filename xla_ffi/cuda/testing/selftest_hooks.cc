// Self-test hooks of the CUDA kernels on the test module, for tests marked `gpu`.
//
// cuda_selftest_layout runs the layout kernels on host inputs (or, with reference=True, the host
// kernels of the same name); cuda_selftest_transport runs rounds of every exchange with R ranks'
// windows on one GPU (transport_reference.h is its host twin). Inputs are validated first: a bad
// row index would make the CUDA kernels fault, and rows written twice would make the result depend
// on the order of writes. Plain C++: compiled by the host compiler against the CUDA runtime API,
// calling the runtime's launchers and the test module's harness.
#include "xla_ffi/cuda/testing/selftest_hooks.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/string.h"
#include "xla_ffi/cuda/layout_kernels.h"
#include "xla_ffi/cuda/testing/hook_support.h"
#include "xla_ffi/cuda/testing/transport_harness.h"
#include "xla_ffi/cuda/transport.h"
#include "xla_ffi/cuda/windows.h"
#include "xla_ffi/exchange.h"
#include "xla_ffi/layout.h"
#include "xla_ffi/numeric.h"
#include "xla_ffi/testing/transport_reference.h"

namespace nb = nanobind;

namespace jax_hybridep {
namespace {
nb::dict SelftestLayout(HostArray<int32_t> topk_idx, int64_t num_experts,
                        HostArray<int64_t> placement_rank, HostArray<int64_t> placement_slot,
                        int64_t num_slots, int64_t capacity, int64_t rows, int64_t pad_multiple,
                        bool reference) {
  Require(topk_idx.ndim() == 3, "topk_idx: expected [R, T, K]");
  const int64_t R = topk_idx.shape(0), T = topk_idx.shape(1), K = topk_idx.shape(2);
  const int64_t E = num_experts;
  Require(R > 0 && E > 0 && num_slots > 0 && pad_multiple > 0 && rows >= 0,
          "need R, num_experts, num_slots, pad_multiple > 0 and rows >= 0");
  RequireShape(placement_rank, "placement_rank", {E});
  RequireShape(placement_slot, "placement_slot", {E});
  for (int64_t e = 0; e < E; ++e) {
    Require(placement_rank.data()[e] >= 0 && placement_rank.data()[e] < R &&
                placement_slot.data()[e] >= 0 && placement_slot.data()[e] < num_slots,
            "placement of expert " + std::to_string(e) + " is outside [0, R) x [0, num_slots)");
  }
  const CapacityPlan plan{capacity, rows, pad_multiple};
  std::vector<int32_t> counts(R * E), keep(E), offset(E), sizes(R * num_slots), tpe(E);
  std::vector<int32_t> row_pos(R * T * K);
  std::vector<int64_t> invalid(R), dropped(R), dropped_per_source(R);
  if (reference) {
    const Placement placement{placement_rank.data(), placement_slot.data(), E, R, num_slots};
    const int32_t* idx = topk_idx.data();
    for (int64_t r = 0; r < R; ++r) {
      invalid[r] = CountRows(idx + r * T * K, T, K, E, counts.data() + r * E);
    }
    PlanGroups(counts.data(), placement, plan, keep.data(), offset.data(), sizes.data(),
               tpe.data());
    for (int64_t r = 0; r < R; ++r) {
      dropped[r] = AssignRows(idx + r * T * K, T, K, r, counts.data(), placement, keep.data(),
                              offset.data(), row_pos.data() + r * T * K);
    }
    DroppedPerSource(counts.data(), R, E, keep.data(), dropped_per_source.data());
  } else {
    // The handler's part of the layout on the GPU: PlanGroups and AssignRows over the counts XLA
    // all-gathers in production (counted here on the host, as jnp counts them there).
    for (int64_t r = 0; r < R; ++r) {
      CountRows(topk_idx.data() + r * T * K, T, K, E, counts.data() + r * E);
    }
    GpuSession gpu;
    cudaStream_t s = gpu.stream();
    const int32_t* idx = gpu.Upload(topk_idx.data(), R * T * K);
    const Placement placement{gpu.Upload(placement_rank.data(), E),
                              gpu.Upload(placement_slot.data(), E), E, R, num_slots};
    const int32_t* d_counts = gpu.Upload(counts.data(), R * E);
    int32_t* d_keep = gpu.Zeros<int32_t>(E);
    int32_t* d_offset = gpu.Zeros<int32_t>(E);
    int32_t* d_sizes = gpu.Zeros<int32_t>(R * num_slots);
    int32_t* d_tpe = gpu.Zeros<int32_t>(E);
    int32_t* d_row_pos = gpu.Zeros<int32_t>(R * T * K);
    int64_t* d_dropped = gpu.Zeros<int64_t>(R);
    const size_t workspace_bytes = AssignRowsWorkspaceBytes(T, K, E);
    void* workspace = gpu.Zeros<char>(workspace_bytes);
    CheckCuda(LaunchPlanGroups(d_counts, placement, plan, d_keep, d_offset, d_sizes, d_tpe, s),
              "LaunchPlanGroups");
    for (int64_t r = 0; r < R; ++r) {
      CheckCuda(
          LaunchAssignRows(idx + r * T * K, T, K, r, d_counts, placement, d_keep, d_offset,
                           d_row_pos + r * T * K, d_dropped + r, workspace, workspace_bytes, s),
          "LaunchAssignRows");
    }
    keep = gpu.Download(d_keep, E);
    offset = gpu.Download(d_offset, E);
    sizes = gpu.Download(d_sizes, R * num_slots);
    tpe = gpu.Download(d_tpe, E);
    row_pos = gpu.Download(d_row_pos, R * T * K);
    dropped = gpu.Download(d_dropped, R);
  }
  const size_t r = R, e = E, t = T, k = K, slots = num_slots;
  nb::dict out;
  if (reference) {  // the steps the GPU does not run (the counts are its input)
    out["counts"] = ToNumpy(std::move(counts), {r, e});
    out["invalid"] = ToNumpy(std::move(invalid), {r});
    out["dropped_per_source"] = ToNumpy(std::move(dropped_per_source), {r});
  }
  out["keep_limit"] = ToNumpy(std::move(keep), {e});
  out["group_offset"] = ToNumpy(std::move(offset), {e});
  out["group_sizes"] = ToNumpy(std::move(sizes), {r, slots});
  out["tokens_per_expert"] = ToNumpy(std::move(tpe), {e});
  out["row_pos"] = ToNumpy(std::move(row_pos), {r, t, k});
  out["dropped"] = ToNumpy(std::move(dropped), {r});
  return out;
}

// The transport (transport.h) with R ranks' windows on this one GPU, `N` rounds of dispatch,
// combine, redispatch (scaled) and row values, each round with its own inputs (leading dimension
// N), all on the same windows so later rounds reuse both halves. Two drivers:
//  * the virtual-rank harness: each exchange one cooperative launch with every rank's blocks
//    resident (the host waits after each);
//  * per-rank streams: the per-rank launchers of the FFI handlers, rank r on its own stream, every
//    round enqueued before the host waits once, so a rank's next send can overlap a peer's
//    receive as it would across GPUs. Needs the ranks' kernels to run side by side: keep
//    R * send_blocks small.
// With ipc_rank >= 0 this process runs that one rank on per-rank streams, its window a registered
// multi-process window (windows.h: the other ranks' come by CUDA IPC through the key-value
// exchange set with set_kv_exchange), and only that rank's outputs are filled.
// Byte arrays are uint8; outputs are stacked [N, R, ...].
nb::dict SelftestTransport(const std::string& dtype_name, int64_t rows, HostArray<uint8_t> x,
                           HostArray<int32_t> dest, HostArray<int32_t> row_pos,
                           HostArray<float> weights, HostArray<uint8_t> y,
                           std::optional<HostArray<float>> y_weights, HostArray<uint8_t> g,
                           HostArray<float> scale, HostArray<float> values, int64_t send_blocks,
                           bool per_rank_streams, int64_t timeout_ms, int64_t ipc_rank,
                           int64_t ipc_group) {
  const TransportRounds in = CheckTransportRounds(dtype_name, rows, x, dest, row_pos, weights, y,
                                                  y_weights, g, scale, values);
  const Dtype dtype = in.dtype;
  const int64_t N = in.N, R = in.R, T = in.T, K = in.K, C = in.C, row_bytes = in.row_bytes;
  int resident = 0;
  CheckCuda(HarnessResidentBlocks(R, &resident), "HarnessResidentBlocks");
  Require(send_blocks >= 1 && send_blocks <= resident,
          "send_blocks must be in [1, " + std::to_string(resident) +
              "] for R=" + std::to_string(R) + " ranks to be resident on this GPU");

  Require(ipc_rank < R, "ipc_rank must be < R");
  const bool ipc = ipc_rank >= 0;
  per_rank_streams = per_rank_streams || ipc;

  GpuSession gpu;
  const WindowGeometry geometry{R, T, K, row_bytes};
  // Every rank's window and error record as the kernels address them, and the host's view.
  const Window* d_windows = nullptr;
  std::vector<TransportError*> error_device(R, nullptr);
  std::vector<const TransportError*> error_host(R, nullptr);
  std::unique_ptr<void, cudaError_t (*)(void*)> host_error_owner(nullptr, cudaFreeHost);
  RankWindow* view = nullptr;
  if (ipc) {
    int device = 0;
    CheckCuda(cudaGetDevice(&device), "cudaGetDevice");
    const Status s = AcquireWindow(WindowKey{ipc_group, geometry, /*multi_process=*/true},
                                   static_cast<int32_t>(ipc_rank), device,
                                   std::chrono::milliseconds(timeout_ms), &view);
    Require(s.ok(), s.message);
    d_windows = view->windows;
    error_device[ipc_rank] = view->error_device;
    error_host[ipc_rank] = view->error_host;
  } else {
    std::vector<Window> windows(R);
    for (int64_t r = 0; r < R; ++r) {
      windows[r] = CarveWindow(gpu.Zeros<char>(WindowBytes(geometry)), geometry);
    }
    d_windows = gpu.Upload(windows.data(), R);
    void* host_error = nullptr;
    CheckCuda(cudaHostAlloc(&host_error, sizeof(TransportError) * R, cudaHostAllocMapped),
              "cudaHostAlloc");
    host_error_owner.reset(host_error);
    std::memset(host_error, 0, sizeof(TransportError) * R);
    void* mapped_error = nullptr;
    CheckCuda(cudaHostGetDevicePointer(&mapped_error, host_error, 0), "cudaHostGetDevicePointer");
    for (int64_t r = 0; r < R; ++r) {
      error_device[r] = static_cast<TransportError*>(mapped_error) + r;
      error_host[r] = static_cast<const TransportError*>(host_error) + r;
    }
  }
  auto check_errors = [&] {
    for (const TransportError* e : error_host) {
      if (e == nullptr) continue;
      Require(e->code == 0, "exchange " + std::to_string(e->generation) + ": rank " +
                                std::to_string(e->rank) + " timed out waiting for rank " +
                                std::to_string(e->peer) + " block " + std::to_string(e->block));
    }
  };

  // Inputs and per-round outputs, all [N, R, ...] on the device.
  auto up = [&](const auto& a) { return gpu.Upload(a.data(), a.size()); };
  const char* d_x = reinterpret_cast<const char*>(up(x));
  const char* d_y = reinterpret_cast<const char*>(up(y));
  const char* d_g = reinterpret_cast<const char*>(up(g));
  const int32_t *d_dest = up(dest), *d_row_pos = up(row_pos);
  const float *d_weights = up(weights), *d_scale = up(scale), *d_values = up(values);
  const float* d_y_weights = y_weights ? up(*y_weights) : nullptr;
  char* tokens = gpu.Zeros<char>(N * R * C * row_bytes);
  float* row_weights = gpu.Zeros<float>(N * R * C);
  int32_t* recv_row_pos = gpu.Zeros<int32_t>(N * R * R * T * K);
  char* combined = gpu.Zeros<char>(N * R * T * row_bytes);
  char* redispatched = gpu.Zeros<char>(N * R * C * row_bytes);
  char* scaled = gpu.Zeros<char>(N * R * C * row_bytes);
  float* row_values = gpu.Zeros<float>(N * R * T * K);

  uint64_t generation = ipc ? view->generation : 0;
  auto context = [&](int64_t r, uint64_t gen) {
    return ExchangeContext{d_windows,
                           R,
                           T,
                           K,
                           row_bytes,
                           static_cast<int32_t>(r),
                           gen,
                           static_cast<int32_t>(send_blocks),
                           timeout_ms * 1000000,
                           error_device[r]};
  };
  // Per (round, rank) slices.
  auto at = [&](auto* base, int64_t n, int64_t r, int64_t per_rank) {
    return base + (n * R + r) * per_rank;
  };
  const int64_t tk = T * K, rc = C * row_bytes, rt = T * row_bytes;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t r = 0; r < R; ++r) {
      CheckCuda(
          LaunchPrefillRedispatch(C, row_bytes, dtype, at(d_scale, n, r, C),
                                  at(redispatched, n, r, rc), at(scaled, n, r, rc), gpu.stream()),
          "LaunchPrefillRedispatch");
    }
  }
  CheckCuda(cudaStreamSynchronize(gpu.stream()), "prefill");

  if (per_rank_streams) {
    std::vector<cudaStream_t> streams(R);
    for (auto& st : streams) CheckCuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "s");
    auto launch = [&](cudaError_t status, const char* what) { CheckCuda(status, what); };
    // Phase by phase across the ranks: with more streams than hardware queues, a rank's
    // receive may share a queue with a peer's send, which must then be ahead of it.
    auto each_rank = [&](auto&& enqueue) {
      for (int64_t r = 0; r < R; ++r) {
        if (ipc && r != ipc_rank) continue;  // the other ranks run in their own processes
        enqueue(r, streams[r]);
      }
    };
    for (int64_t n = 0; n < N; ++n) {
      const uint64_t first = generation;
      generation += 4;
      auto map = [&](int64_t r) { return at(recv_row_pos, n, r, R * tk); };
      each_rank([&](int64_t r, cudaStream_t st) {
        launch(LaunchSendTokens(context(r, first + 1), at(d_x, n, r, rt), at(d_dest, n, r, tk),
                                at(d_row_pos, n, r, tk), at(d_weights, n, r, tk), st),
               "send");
      });
      each_rank([&](int64_t r, cudaStream_t st) {
        launch(LaunchReceiveRows(context(r, first + 1), at(tokens, n, r, rc),
                                 at(row_weights, n, r, C), map(r), C, st),
               "receive");
      });
      each_rank([&](int64_t r, cudaStream_t st) {
        launch(LaunchSendPartials(context(r, first + 2), dtype, at(d_y, n, r, rc),
                                  d_y_weights ? at(d_y_weights, n, r, C) : nullptr, map(r), st),
               "partials");
      });
      each_rank([&](int64_t r, cudaStream_t st) {
        launch(LaunchReducePartials(context(r, first + 2), dtype, at(d_dest, n, r, tk),
                                    at(combined, n, r, rt), st),
               "reduce");
      });
      each_rank([&](int64_t r, cudaStream_t st) {
        launch(LaunchSendTokens(context(r, first + 3), at(d_g, n, r, rt), at(d_dest, n, r, tk),
                                nullptr, nullptr, st),
               "resend");
      });
      each_rank([&](int64_t r, cudaStream_t st) {
        launch(LaunchReceiveRedispatch(context(r, first + 3), dtype, map(r), at(d_scale, n, r, C),
                                       at(redispatched, n, r, rc), at(scaled, n, r, rc), st),
               "rereceive");
      });
      each_rank([&](int64_t r, cudaStream_t st) {
        launch(LaunchSendRowValues(context(r, first + 4), at(d_values, n, r, C), map(r), st),
               "values");
      });
      each_rank([&](int64_t r, cudaStream_t st) {
        launch(LaunchReceiveRowValues(context(r, first + 4), at(d_dest, n, r, tk),
                                      at(row_values, n, r, tk), st),
               "values back");
      });
    }
    for (auto& st : streams) {
      CheckCuda(cudaStreamSynchronize(st), "per-rank kernels");
      cudaStreamDestroy(st);
    }
    if (ipc) view->generation = generation;
    check_errors();
  } else {
    std::vector<ExchangeContext> contexts(R);
    ExchangeContext* d_contexts = gpu.Zeros<ExchangeContext>(R);
    auto run = [&](HarnessExchange exchange, HarnessArgs a) {
      ++generation;
      for (int64_t r = 0; r < R; ++r) contexts[r] = context(r, generation);
      CheckCuda(cudaMemcpyAsync(d_contexts, contexts.data(), sizeof(ExchangeContext) * R,
                                cudaMemcpyHostToDevice, gpu.stream()),
                "cudaMemcpyAsync");
      a.exchange = exchange;
      CheckCuda(LaunchHarness(d_contexts, R, static_cast<int32_t>(send_blocks), a, gpu.stream()),
                "LaunchHarness");
      CheckCuda(cudaStreamSynchronize(gpu.stream()), "harness kernel");
      check_errors();
    };
    for (int64_t n = 0; n < N; ++n) {
      HarnessArgs a{};
      a.dtype = dtype;
      a.rows = C;
      a.dest = at(d_dest, n, 0, tk);
      a.row_pos = at(d_row_pos, n, 0, tk);
      a.recv_row_pos = at(recv_row_pos, n, 0, R * tk);
      a.in_rows = at(d_x, n, 0, rt), a.in_values = at(d_weights, n, 0, tk);
      a.out_rows = at(tokens, n, 0, rc), a.out_values = at(row_weights, n, 0, C);
      run(HarnessExchange::kDispatch, a);
      a.in_rows = at(d_y, n, 0, rc), a.out_rows = at(combined, n, 0, rt);
      a.in_values = d_y_weights ? at(d_y_weights, n, 0, C) : nullptr;
      run(HarnessExchange::kCombine, a);
      a.in_rows = at(d_g, n, 0, rt), a.in_values = at(d_scale, n, 0, C);
      a.out_rows = at(redispatched, n, 0, rc), a.out_scaled = at(scaled, n, 0, rc);
      run(HarnessExchange::kRedispatch, a);
      a.in_values = at(d_values, n, 0, C), a.out_values = at(row_values, n, 0, tk);
      a.out_scaled = nullptr;
      run(HarnessExchange::kRowValues, a);
    }
  }
  auto bytes = [&](const char* device, size_t count) {
    const std::vector<char> host = gpu.Download(device, count);
    return std::vector<uint8_t>(host.begin(), host.end());
  };
  const size_t n = N, r = R, t = T, k = K, c = C, rb = row_bytes;
  nb::dict out;
  out["tokens"] = ToNumpy(bytes(tokens, n * r * c * rb), {n, r, c, rb});
  out["weights"] = ToNumpy(gpu.Download(row_weights, n * r * c), {n, r, c});
  out["recv_row_pos"] = ToNumpy(gpu.Download(recv_row_pos, n * r * r * t * k), {n, r, r * t, k});
  out["combined"] = ToNumpy(bytes(combined, n * r * t * rb), {n, r, t, rb});
  out["redispatched"] = ToNumpy(bytes(redispatched, n * r * c * rb), {n, r, c, rb});
  out["scaled"] = ToNumpy(bytes(scaled, n * r * c * rb), {n, r, c, rb});
  out["row_values"] = ToNumpy(gpu.Download(row_values, n * r * t * k), {n, r, t, k});
  out["blocks_resident"] = resident;
  return out;
}

}  // namespace

void RegisterCudaSelftests(nb::module_& m) {
  m.def("cuda_device_count", &CudaDeviceCount,
        "Visible CUDA devices; 0 when there is no driver or GPU.");
  m.def("cuda_selftest_layout", &SelftestLayout, nb::arg("topk_idx"), nb::arg("num_experts"),
        nb::arg("placement_rank"), nb::arg("placement_slot"), nb::arg("num_slots"),
        nb::arg("capacity"), nb::arg("rows"), nb::arg("pad_multiple"), nb::arg("reference") = false,
        "Layout of all ranks (topk_idx [R, T, K]): PlanGroups and AssignRows on the GPU over the "
        "host's counts, or with reference=True every step (CountRows, PlanGroups, AssignRows, "
        "DroppedPerSource) on the host, whose dict also holds counts, invalid and "
        "dropped_per_source.");
  m.def(
      "cuda_selftest_transport", &SelftestTransport, nb::arg("dtype"), nb::arg("rows"),
      nb::arg("x"), nb::arg("dest"), nb::arg("row_pos"), nb::arg("weights"), nb::arg("y"),
      nb::arg("y_weights").none(), nb::arg("g"), nb::arg("scale"), nb::arg("values"),
      nb::arg("send_blocks"), nb::arg("per_rank_streams") = false, nb::arg("timeout_ms") = 10000,
      nb::arg("ipc_rank") = -1, nb::arg("ipc_group") = 0,
      "The direct-write transport with R ranks on this GPU: N rounds (the inputs' leading "
      "dimension) of dispatch, combine, redispatch (scaled) and row values on the same windows, "
      "through the virtual-rank harness or the per-rank launchers on R streams, or (ipc_rank >= 0) "
      "only that rank, its peers in other processes reached by CUDA IPC. Returns a dict of "
      "[N, R, ...] results.");
}

}  // namespace jax_hybridep
