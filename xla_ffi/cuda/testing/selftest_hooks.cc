// Self-test hooks of the CUDA kernels on the test module, for tests marked `gpu`.
//
// Each cuda_selftest_* takes host numpy arrays, runs one step on the GPU (or, with
// reference=True, the host kernel of the same name on the same inputs) and returns host arrays, so
// a test can compare the two bit for bit. Inputs are validated first: a bad row index would make
// the host kernel write out of bounds and the CUDA kernel fault, and rows or tokens written twice
// would make the result depend on the order of writes. Plain C++: compiled by the host compiler
// against the CUDA runtime API, linked with the nvcc-built launchers.
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
#include "xla_ffi/cuda/kernels.h"
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
// A receive buffer's metadata: token_ids [R, T] and row_pos [R, T, K]. Checks the ranges and that
// no (source, token) and no row appears twice among the filled slots.
void CheckRecvMetadata(const HostArray<int32_t>& token_ids, const HostArray<int32_t>& row_pos,
                       int64_t rows, bool rows_unique) {
  Require(token_ids.ndim() == 2, "token_ids: expected [R, T]");
  const int64_t R = token_ids.shape(0), T = token_ids.shape(1);
  Require(row_pos.ndim() == 3, "row_pos: expected [R, T, K]");
  RequireShape(row_pos, "row_pos", {R, T, static_cast<int64_t>(row_pos.shape(2))});
  const int64_t K = row_pos.shape(2);
  RequireRange(token_ids.data(), token_ids.size(), T, "token_ids");
  RequireRange(row_pos.data(), row_pos.size(), rows, "row_pos");
  std::set<std::pair<int64_t, int32_t>> tokens;
  std::set<int32_t> used_rows;
  for (int64_t slot = 0; slot < R * T; ++slot) {
    if (token_ids.data()[slot] < 0) continue;
    Require(tokens.insert({slot / T, token_ids.data()[slot]}).second,
            "token_ids: a source sends one token twice");
    for (int64_t j = 0; rows_unique && j < K; ++j) {
      const int32_t row = row_pos.data()[slot * K + j];
      Require(row < 0 || used_rows.insert(row).second, "row_pos: a row is filled twice");
    }
  }
}

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
    GpuSession gpu;
    cudaStream_t s = gpu.stream();
    const int32_t* idx = gpu.Upload(topk_idx.data(), R * T * K);
    const Placement placement{gpu.Upload(placement_rank.data(), E),
                              gpu.Upload(placement_slot.data(), E), E, R, num_slots};
    int32_t* d_counts = gpu.Zeros<int32_t>(R * E);
    int32_t* d_keep = gpu.Zeros<int32_t>(E);
    int32_t* d_offset = gpu.Zeros<int32_t>(E);
    int32_t* d_sizes = gpu.Zeros<int32_t>(R * num_slots);
    int32_t* d_tpe = gpu.Zeros<int32_t>(E);
    int32_t* d_row_pos = gpu.Zeros<int32_t>(R * T * K);
    int64_t* d_invalid = gpu.Zeros<int64_t>(R);
    int64_t* d_dropped = gpu.Zeros<int64_t>(R);
    int64_t* d_dropped_per_source = gpu.Zeros<int64_t>(R);
    const size_t workspace_bytes = AssignRowsWorkspaceBytes(T, K, E);
    void* workspace = gpu.Zeros<char>(workspace_bytes);
    for (int64_t r = 0; r < R; ++r) {
      CheckCuda(LaunchCountRows(idx + r * T * K, T, K, E, d_counts + r * E, d_invalid + r, s),
                "LaunchCountRows");
    }
    CheckCuda(LaunchPlanGroups(d_counts, placement, plan, d_keep, d_offset, d_sizes, d_tpe, s),
              "LaunchPlanGroups");
    for (int64_t r = 0; r < R; ++r) {
      CheckCuda(
          LaunchAssignRows(idx + r * T * K, T, K, r, d_counts, placement, d_keep, d_offset,
                           d_row_pos + r * T * K, d_dropped + r, workspace, workspace_bytes, s),
          "LaunchAssignRows");
    }
    CheckCuda(LaunchDroppedPerSource(d_counts, R, E, d_keep, d_dropped_per_source, s),
              "LaunchDroppedPerSource");
    counts = gpu.Download(d_counts, R * E);
    keep = gpu.Download(d_keep, E);
    offset = gpu.Download(d_offset, E);
    sizes = gpu.Download(d_sizes, R * num_slots);
    tpe = gpu.Download(d_tpe, E);
    row_pos = gpu.Download(d_row_pos, R * T * K);
    invalid = gpu.Download(d_invalid, R);
    dropped = gpu.Download(d_dropped, R);
    dropped_per_source = gpu.Download(d_dropped_per_source, R);
  }
  const size_t r = R, e = E, t = T, k = K, slots = num_slots;
  nb::dict out;
  out["counts"] = ToNumpy(std::move(counts), {r, e});
  out["invalid"] = ToNumpy(std::move(invalid), {r});
  out["keep_limit"] = ToNumpy(std::move(keep), {e});
  out["group_offset"] = ToNumpy(std::move(offset), {e});
  out["group_sizes"] = ToNumpy(std::move(sizes), {r, slots});
  out["tokens_per_expert"] = ToNumpy(std::move(tpe), {e});
  out["row_pos"] = ToNumpy(std::move(row_pos), {r, t, k});
  out["dropped"] = ToNumpy(std::move(dropped), {r});
  out["dropped_per_source"] = ToNumpy(std::move(dropped_per_source), {r});
  return out;
}

nb::tuple SelftestExpandRows(HostArray<uint8_t> tokens, HostArray<int32_t> token_ids,
                             HostArray<int32_t> row_pos, HostArray<float> weights, int64_t rows,
                             bool reference) {
  CheckRecvMetadata(token_ids, row_pos, rows, /*rows_unique=*/true);
  const int64_t R = token_ids.shape(0), T = token_ids.shape(1), K = row_pos.shape(2);
  Require(tokens.ndim() == 3, "tokens: expected [R, T, row_bytes]");
  const int64_t row_bytes = tokens.shape(2);
  RequireShape(tokens, "tokens", {R, T, row_bytes});
  RequireShape(weights, "weights", {R, T, K});
  const ExchangeShape shape{R, T, K, rows, row_bytes};
  std::vector<char> out_tokens(rows * row_bytes);
  std::vector<float> out_weights(rows);
  if (reference) {
    std::vector<char> recv_tokens(tokens.data(), tokens.data() + tokens.size());
    std::vector<int32_t> ids(token_ids.data(), token_ids.data() + token_ids.size());
    std::vector<int32_t> pos(row_pos.data(), row_pos.data() + row_pos.size());
    std::vector<float> w(weights.data(), weights.data() + weights.size());
    const DispatchRecvBuffer recv{recv_tokens.data(), ids.data(), pos.data(), w.data()};
    ExpandRows(shape, recv, out_tokens.data(), out_weights.data());
  } else {
    GpuSession gpu;
    const DispatchRecvBuffer recv{
        gpu.Upload(reinterpret_cast<const char*>(tokens.data()), tokens.size()),
        gpu.Upload(token_ids.data(), token_ids.size()), gpu.Upload(row_pos.data(), row_pos.size()),
        gpu.Upload(weights.data(), weights.size())};
    char* d_tokens = gpu.Zeros<char>(rows * row_bytes);
    float* d_weights = gpu.Zeros<float>(rows);
    CheckCuda(LaunchExpandRows(shape, recv, d_tokens, d_weights, gpu.stream()), "LaunchExpandRows");
    out_tokens = gpu.Download(d_tokens, rows * row_bytes);
    out_weights = gpu.Download(d_weights, rows);
  }
  std::vector<uint8_t> bytes(out_tokens.begin(), out_tokens.end());
  return nb::make_tuple(
      ToNumpy(std::move(bytes), {static_cast<size_t>(rows), static_cast<size_t>(row_bytes)}),
      ToNumpy(std::move(out_weights), {static_cast<size_t>(rows)}));
}

// Returns every source's partial buffer, [R (source), R (destination), T, row_bytes], zero where
// `rank` wrote nothing.
nb::object SelftestWritePartials(const std::string& dtype_name, int64_t rank, HostArray<uint8_t> y,
                                 std::optional<HostArray<float>> weights,
                                 HostArray<int32_t> token_ids, HostArray<int32_t> recv_row_pos,
                                 bool reference) {
  const Dtype dtype = ParseDtype(dtype_name);
  Require(y.ndim() == 2, "y: expected [C, row_bytes]");
  const int64_t C = y.shape(0), row_bytes = y.shape(1);
  Require(row_bytes % DtypeBytes(dtype) == 0, "y: row_bytes is not whole elements");
  CheckRecvMetadata(token_ids, recv_row_pos, C, /*rows_unique=*/false);
  if (weights) RequireShape(*weights, "weights", {C});
  const int64_t R = token_ids.shape(0), T = token_ids.shape(1), K = recv_row_pos.shape(2);
  Require(rank >= 0 && rank < R, "rank must be in [0, R)");
  const ExchangeShape shape{R, T, K, C, row_bytes};
  const size_t buffer_bytes = R * T * row_bytes;
  std::vector<uint8_t> out(R * buffer_bytes);
  if (reference) {
    std::vector<char*> peers(R);
    for (int64_t src = 0; src < R; ++src) {
      peers[src] = reinterpret_cast<char*>(out.data() + src * buffer_bytes);
    }
    WritePartials(shape, rank, dtype, reinterpret_cast<const char*>(y.data()),
                  weights ? weights->data() : nullptr, token_ids.data(), recv_row_pos.data(),
                  peers.data());
  } else {
    GpuSession gpu;
    std::vector<char*> peers(R);
    // One allocation per source, as peers' buffers would be.
    for (int64_t src = 0; src < R; ++src) peers[src] = gpu.Zeros<char>(buffer_bytes);
    CheckCuda(LaunchWritePartials(shape, rank, dtype,
                                  gpu.Upload(reinterpret_cast<const char*>(y.data()), y.size()),
                                  weights ? gpu.Upload(weights->data(), C) : nullptr,
                                  gpu.Upload(token_ids.data(), token_ids.size()),
                                  gpu.Upload(recv_row_pos.data(), recv_row_pos.size()),
                                  gpu.Upload(peers.data(), R), gpu.stream()),
              "LaunchWritePartials");
    for (int64_t src = 0; src < R; ++src) {
      const std::vector<char> part = gpu.Download(peers[src], buffer_bytes);
      std::copy(part.begin(), part.end(), out.begin() + src * buffer_bytes);
    }
  }
  const size_t r = R;
  return ToNumpy(std::move(out), {r, r, static_cast<size_t>(T), static_cast<size_t>(row_bytes)});
}

nb::object SelftestReducePartials(const std::string& dtype_name, HostArray<uint8_t> partials,
                                  HostArray<int32_t> dest, bool reference) {
  const Dtype dtype = ParseDtype(dtype_name);
  Require(partials.ndim() == 3, "partials: expected [R, T, row_bytes]");
  Require(dest.ndim() == 2, "dest: expected [T, K]");
  const int64_t R = partials.shape(0), T = partials.shape(1), row_bytes = partials.shape(2);
  const int64_t K = dest.shape(1);
  RequireShape(dest, "dest", {T, K});
  Require(row_bytes % DtypeBytes(dtype) == 0, "partials: row_bytes is not whole elements");
  RequireRange(dest.data(), dest.size(), R, "dest");
  const ExchangeShape shape{R, T, K, /*rows=*/0, row_bytes};
  std::vector<char> out(T * row_bytes);
  if (reference) {
    ReducePartials(shape, dtype, reinterpret_cast<const char*>(partials.data()), dest.data(),
                   out.data());
  } else {
    GpuSession gpu;
    char* d_out = gpu.Zeros<char>(T * row_bytes);
    CheckCuda(LaunchReducePartials(
                  shape, dtype,
                  gpu.Upload(reinterpret_cast<const char*>(partials.data()), partials.size()),
                  gpu.Upload(dest.data(), dest.size()), d_out, gpu.stream()),
              "LaunchReducePartials");
    out = gpu.Download(d_out, T * row_bytes);
  }
  std::vector<uint8_t> bytes(out.begin(), out.end());
  return ToNumpy(std::move(bytes), {static_cast<size_t>(T), static_cast<size_t>(row_bytes)});
}

// Returns every source's [T, K] buffer, stacked to [R, T, K], zero where nothing was written.
nb::object SelftestWriteRowValues(HostArray<float> values, HostArray<int32_t> token_ids,
                                  HostArray<int32_t> recv_row_pos, bool reference) {
  Require(values.ndim() == 1, "values: expected [C]");
  const int64_t C = values.shape(0);
  CheckRecvMetadata(token_ids, recv_row_pos, C, /*rows_unique=*/false);
  const int64_t R = token_ids.shape(0), T = token_ids.shape(1), K = recv_row_pos.shape(2);
  const ExchangeShape shape{R, T, K, C, /*row_bytes=*/0};
  std::vector<float> out(R * T * K);
  if (reference) {
    std::vector<float*> peers(R);
    for (int64_t src = 0; src < R; ++src) peers[src] = out.data() + src * T * K;
    WriteRowValues(shape, values.data(), token_ids.data(), recv_row_pos.data(), peers.data());
  } else {
    GpuSession gpu;
    std::vector<float*> peers(R);
    for (int64_t src = 0; src < R; ++src) peers[src] = gpu.Zeros<float>(T * K);
    CheckCuda(LaunchWriteRowValues(shape, gpu.Upload(values.data(), C),
                                   gpu.Upload(token_ids.data(), token_ids.size()),
                                   gpu.Upload(recv_row_pos.data(), recv_row_pos.size()),
                                   gpu.Upload(peers.data(), R), gpu.stream()),
              "LaunchWriteRowValues");
    for (int64_t src = 0; src < R; ++src) {
      const std::vector<float> part = gpu.Download(peers[src], T * K);
      std::copy(part.begin(), part.end(), out.begin() + src * T * K);
    }
  }
  const size_t r = R, t = T, k = K;
  return ToNumpy(std::move(out), {r, t, k});
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
        "Layout of all ranks (topk_idx [R, T, K]): CountRows, PlanGroups, AssignRows and "
        "DroppedPerSource on the GPU, or with reference=True on the host. Returns a dict.");
  m.def("cuda_selftest_expand_rows", &SelftestExpandRows, nb::arg("tokens"), nb::arg("token_ids"),
        nb::arg("row_pos"), nb::arg("weights"), nb::arg("rows"), nb::arg("reference") = false,
        "ExpandRows of a receive buffer (tokens uint8 [R, T, row_bytes]). Returns (tokens uint8 "
        "[C, row_bytes], weights [C]).");
  m.def("cuda_selftest_write_partials", &SelftestWritePartials, nb::arg("dtype"), nb::arg("rank"),
        nb::arg("y"), nb::arg("weights").none(), nb::arg("token_ids"), nb::arg("recv_row_pos"),
        nb::arg("reference") = false,
        "WritePartials of destination `rank` (y uint8 [C, row_bytes]). Returns all sources' "
        "partial buffers, uint8 [R, R, T, row_bytes].");
  m.def("cuda_selftest_reduce_partials", &SelftestReducePartials, nb::arg("dtype"),
        nb::arg("partials"), nb::arg("dest"), nb::arg("reference") = false,
        "ReducePartials (partials uint8 [R, T, row_bytes], dest [T, K]). Returns uint8 "
        "[T, row_bytes].");
  m.def("cuda_selftest_write_row_values", &SelftestWriteRowValues, nb::arg("values"),
        nb::arg("token_ids"), nb::arg("recv_row_pos"), nb::arg("reference") = false,
        "WriteRowValues (values [C]). Returns all sources' buffers, [R, T, K].");
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
