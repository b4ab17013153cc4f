// The transport's virtual-rank harness (hooks.h): R ranks of one level, each with its own
// window, running the kernels of the FFI handlers (layout, send, permute, unpermute, send back,
// reduce) with nothing but the flags between ranks. Two placements:
//   * every rank on this GPU's one stream: the sends never wait, so every exchange enqueues all
//     ranks' sends before any rank's receive (no residency needed);
//   * per_rank_devices: rank r on device r with its own stream, as across the GPUs of a node
//     (the host executor's virtual GPUs, docs/host_executor.md). Without sync_each_phase the
//     caller waits only at the end, so a rank's next exchange overlaps its peers' last one.
// Rounds reuse the windows, so both halves and the exchange counters are exercised; a rank can
// be made to tag its flags with another call site (the waits must report a mismatch) or to send
// nothing (they must time out).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "lab/native/cuda/hook_support.h"
#include "lab/native/cuda/hooks.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/string.h"
#include "xla_ffi/common/fp8.h"
#include "xla_ffi/cuda/kernels/slot_map.h"
#include "xla_ffi/cuda/kernels/transport.h"

namespace jax_hybridep {
namespace {

std::string FailureMessage(const TransportError& e) {
  std::string what =
      e.code == kWaitMismatch ? "found a flag of another exchange (mismatch)" : "timed out";
  return "exchange " + std::to_string(e.generation) + ": rank " + std::to_string(e.rank) +
         " waiting for rank " + std::to_string(e.peer) + " block " + std::to_string(e.block) + " " +
         what + "; flag " + std::to_string(e.seen) + ", expected " + std::to_string(e.expected);
}

// Rank r's share of a [N, R, per] numpy array: [N, per], contiguous.
template <typename T>
std::vector<T> RankSlice(const T* data, int64_t N, int64_t R, int64_t r, int64_t per) {
  std::vector<T> out(N * per);
  for (int64_t n = 0; n < N; ++n) {
    std::memcpy(out.data() + n * per, data + (n * R + r) * per, per * sizeof(T));
  }
  return out;
}

// One rank's device memory, on its session's GPU: inputs of every round, the window, scratch,
// and per-round outputs ([N, ...] each).
struct RankMemory {
  const char *x, *y, *g;
  const int32_t* dest;
  const float *scale, *y_weights;
  const int32_t* rank;
  int32_t* gathered;
  char* workspace;
  char* partials;
  int32_t *send_slot, *recv_item, *recv_rows, *row_slot, *info;
  float* row_weights;
  char *tokens, *combined, *redispatched, *scaled;
};

nb::dict SelftestTransport(const std::string& dtype_name, int64_t rows, CpuArray<uint8_t> x,
                           CpuArray<int32_t> dest, CpuArray<int32_t> row_pos,
                           CpuArray<float> weights, CpuArray<uint8_t> y,
                           std::optional<CpuArray<float>> y_weights, CpuArray<uint8_t> g,
                           CpuArray<float> scale, int64_t send_blocks, int64_t fp8_hidden,
                           int64_t zero_pad_multiple, int64_t timeout_ms, int64_t mismatch_rank,
                           int64_t silent_rank, bool per_rank_devices, bool sync_each_phase) {
  const Dtype dtype = ParseDtype(dtype_name);
  Require(x.ndim() == 4 && dest.ndim() == 4,
          "x: expected [N, R, M, x_row_bytes], dest [N, R, M, K]");
  const int64_t N = x.shape(0), R = x.shape(1), M = x.shape(2), x_row_bytes = x.shape(3);
  const int64_t K = dest.shape(3), C = rows;
  Require(N >= 1 && R >= 1 && R <= kMaxWindowRanks && K >= 1 && K <= kMaxTopK && C >= 0,
          "need N >= 1 rounds, 1 <= R <= 128 ranks, 1 <= K <= 64 and rows >= 0");
  Require(y.ndim() == 4 && y.shape(3) % DtypeBytes(dtype) == 0, "y: expected [N, R, C, row_bytes]");
  const int64_t row_bytes = y.shape(3), hidden = row_bytes / DtypeBytes(dtype);
  Require(fp8_hidden == 0 || (fp8_hidden == hidden && x_row_bytes == row_bytes),
          "with fp8_hidden, x holds tokens of y's dtype and width");
  Require(fp8_hidden > 0 || x_row_bytes == row_bytes, "x and y rows must have the same bytes");
  RequireShape(dest, "dest", {N, R, M, K});
  RequireShape(row_pos, "row_pos", {N, R, M, K});
  RequireShape(weights, "weights", {N, R, M, K});
  RequireShape(y, "y", {N, R, C, row_bytes});
  if (y_weights) RequireShape(*y_weights, "y_weights", {N, R, C});
  RequireShape(g, "g", {N, R, M, row_bytes});
  RequireShape(scale, "scale", {N, R, C});
  RequireRange(dest.data(), dest.size(), R, "dest");
  RequireRange(row_pos.data(), row_pos.size(), C, "row_pos");
  for (size_t i = 0; i < dest.size(); ++i) {
    Require((dest.data()[i] < 0) == (row_pos.data()[i] < 0), "dest and row_pos disagree on -1");
  }
  Require(send_blocks >= 1 && send_blocks <= kMaxSendBlocks, "send_blocks must be in [1, 256]");
  Require(zero_pad_multiple >= 0, "zero_pad_multiple must be >= 0");
  Require(!per_rank_devices || CudaDeviceCount() >= R,
          "per_rank_devices needs a device per rank: " + std::to_string(CudaDeviceCount()) +
              " devices for " + std::to_string(R) + " ranks");

  std::vector<std::unique_ptr<GpuSession>> sessions;
  for (int64_t r = 0; r < (per_rank_devices ? R : 1); ++r) {
    sessions.push_back(std::make_unique<GpuSession>(per_rank_devices ? static_cast<int>(r) : -1));
  }
  auto gpu = [&](int64_t r) -> GpuSession& { return *sessions[per_rank_devices ? r : 0]; };
  if (per_rank_devices) {
    for (int64_t r = 0; r < R; ++r) {
      gpu(r).Use();
      for (int64_t p = 0; p < R; ++p) {
        if (p == r) continue;
        const cudaError_t s = cudaDeviceEnablePeerAccess(static_cast<int>(p), 0);
        if (s == cudaErrorPeerAccessAlreadyEnabled)
          cudaGetLastError();
        else
          CheckCuda(s, "cudaDeviceEnablePeerAccess");
      }
    }
  }
  const int64_t dispatch_bytes = fp8_hidden > 0 ? Fp8WireBytes(fp8_hidden) : x_row_bytes;
  const WindowGeometry geometry{R, M, std::max(dispatch_bytes, row_bytes)};
  const WindowRegions layout = WindowRegionsFor(geometry);
  PeerWindows peers{};
  // Windows start zeroed, as the window registry clears them (its flags start at 0).
  for (int64_t r = 0; r < R; ++r) peers.base[r] = gpu(r).Zeros<char>(layout.total);
  void* errors_mapped = nullptr;
  CheckCuda(cudaHostAlloc(&errors_mapped, sizeof(TransportError) * R,
                          cudaHostAllocMapped | cudaHostAllocPortable),
            "cudaHostAlloc");
  std::unique_ptr<void, cudaError_t (*)(void*)> errors_owner(errors_mapped, cudaFreeHost);
  std::memset(errors_mapped, 0, sizeof(TransportError) * R);
  void* mapped_error = nullptr;
  CheckCuda(cudaHostGetDevicePointer(&mapped_error, errors_mapped, 0), "cudaHostGetDevicePointer");
  auto exchange = [&](int64_t r, int64_t bytes, uint32_t site) {
    ExchangeParams ex{};
    ex.window = layout;
    ex.own = peers.base[r];
    ex.ranks = static_cast<int32_t>(R);
    ex.rank = static_cast<int32_t>(r);
    ex.items = M;
    ex.row_bytes = bytes;
    ex.send_blocks = static_cast<int32_t>(send_blocks);
    ex.site = r == mismatch_rank ? site + 1000 : site;
    ex.timeout_ns = timeout_ms * 1000000;
    ex.error = static_cast<TransportError*>(mapped_error) + r;
    return ex;
  };
  auto check_errors = [&] {
    for (auto& session : sessions) {
      session->Use();
      CheckCuda(cudaStreamSynchronize(session->stream()), "transport kernels");
    }
    for (int64_t r = 0; r < R; ++r) {
      const TransportError e = static_cast<const TransportError*>(errors_mapped)[r];
      Require(e.code == 0, FailureMessage(e));
    }
  };

  const int64_t mp = ChunkPadded(M), np = ChunkPadded(R * M);
  const int64_t out_row_bytes = fp8_hidden > 0 ? fp8_hidden * DtypeBytes(dtype) : x_row_bytes;
  const SlotMapShape shape{R, M, K, C};
  std::vector<RankMemory> mem(R);
  for (int64_t r = 0; r < R; ++r) {
    GpuSession& s = gpu(r);
    RankMemory& m = mem[r];
    auto up = [&](const auto* data, int64_t per) {
      const auto slice = RankSlice(data, N, R, r, per);
      return s.Upload(slice.data(), slice.size());
    };
    m.x = reinterpret_cast<const char*>(up(x.data(), M * x_row_bytes));
    m.y = reinterpret_cast<const char*>(up(y.data(), C * row_bytes));
    m.g = reinterpret_cast<const char*>(up(g.data(), M * row_bytes));
    m.dest = up(dest.data(), M * K);
    m.scale = up(scale.data(), C);
    m.y_weights = y_weights ? up(y_weights->data(), C) : nullptr;
    const int32_t r32 = static_cast<int32_t>(r);
    m.rank = s.Upload(&r32, 1);
    // What the kernels write themselves (XLA's outputs and scratch in production) as cudaMalloc
    // leaves it, not zeroed: poison the host executor reports reading (initcheck), so a
    // kernel's own zeroing and initialisation are tested.
    m.gathered = s.Uninitialised<int32_t>(R * M * K * 3);
    m.workspace = s.Uninitialised<char>(SlotMapWorkspaceBytes(shape));
    m.partials = s.Uninitialised<char>(np * row_bytes);
    m.send_slot = s.Uninitialised<int32_t>(N * mp * R);
    m.recv_item = s.Uninitialised<int32_t>(N * np);
    m.recv_rows = s.Uninitialised<int32_t>(N * np * K);
    m.row_slot = s.Uninitialised<int32_t>(N * C);
    m.info = s.Uninitialised<int32_t>(N * 2);
    m.row_weights = s.Uninitialised<float>(N * C);
    m.tokens = s.Uninitialised<char>(N * C * out_row_bytes);
    m.combined = s.Uninitialised<char>(N * M * row_bytes);
    m.redispatched = s.Uninitialised<char>(N * C * row_bytes);
    m.scaled = s.Uninitialised<char>(N * C * row_bytes);
  }
  const PaddingFill fill{C, zero_pad_multiple};
  // Every window zeroed and every input in place before any rank's send writes to a peer: the
  // ranks' streams are not ordered with each other.
  check_errors();

  for (int64_t n = 0; n < N; ++n) {
    // The level's routing as the all-gather brings it: (destination, row, weight bits).
    std::vector<int32_t> gathered(R * M * K * 3);
    for (int64_t i = 0; i < R * M * K; ++i) {
      const int64_t at = n * R * M * K + i;
      gathered[3 * i] = dest.data()[at];
      gathered[3 * i + 1] = row_pos.data()[at];
      std::memcpy(&gathered[3 * i + 2], &weights.data()[at], 4);
    }
    auto lay = [&](int64_t r) {
      const RankMemory& m = mem[r];
      return std::make_tuple(m.send_slot + n * mp * R, m.recv_item + n * np,
                             m.recv_rows + n * np * K, m.row_slot + n * C, m.info + n * 2,
                             m.row_weights + n * C);
    };
    for (int64_t r = 0; r < R; ++r) {
      GpuSession& s = gpu(r);
      s.Use();
      const RankMemory& m = mem[r];
      CheckCuda(cudaMemcpyAsync(m.gathered, gathered.data(), gathered.size() * 4,
                                cudaMemcpyHostToDevice, s.stream()),
                "cudaMemcpyAsync");
      const auto [send_slot, recv_item, recv_rows, row_slot, info, row_weights] = lay(r);
      CheckCuda(LaunchSlotMap(shape, m.rank, m.gathered, send_slot, recv_item, recv_rows,
                              row_weights, row_slot, info, m.workspace, s.stream()),
                "LaunchSlotMap");
    }
    // Dispatch: every rank's send, then every rank's permute.
    for (int64_t r = 0; r < R; ++r) {
      if (r == silent_rank) continue;
      gpu(r).Use();
      const auto [send_slot, recv_item, recv_rows, row_slot, info, row_weights] = lay(r);
      CheckCuda(
          LaunchSendRows(exchange(r, dispatch_bytes, 1), peers, mem[r].x + n * M * x_row_bytes,
                         x_row_bytes, send_slot, dtype, fp8_hidden, gpu(r).stream()),
          "LaunchSendRows");
    }
    for (int64_t r = 0; r < R; ++r) {
      gpu(r).Use();
      const auto [send_slot, recv_item, recv_rows, row_slot, info, row_weights] = lay(r);
      CheckCuda(LaunchPermute(exchange(r, dispatch_bytes, 1), K, recv_rows, row_slot, info, fill,
                              mem[r].tokens + n * C * out_row_bytes, out_row_bytes, dtype,
                              fp8_hidden, gpu(r).stream()),
                "LaunchPermute");
    }
    if (sync_each_phase) check_errors();
    // Combine: unpermute locally, send the partials back, reduce.
    for (int64_t r = 0; r < R; ++r) {
      gpu(r).Use();
      const auto [send_slot, recv_item, recv_rows, row_slot, info, row_weights] = lay(r);
      CheckCuda(LaunchUnpermute(dtype, hidden, K, mem[r].y + n * C * row_bytes,
                                mem[r].y_weights ? mem[r].y_weights + n * C : nullptr, recv_rows,
                                info, np, mem[r].partials, gpu(r).stream()),
                "LaunchUnpermute");
    }
    for (int64_t r = 0; r < R; ++r) {
      gpu(r).Use();
      const auto [send_slot, recv_item, recv_rows, row_slot, info, row_weights] = lay(r);
      CheckCuda(LaunchSendPartials(exchange(r, row_bytes, 2), peers, mem[r].partials, recv_item,
                                   info, gpu(r).stream()),
                "LaunchSendPartials");
    }
    for (int64_t r = 0; r < R; ++r) {
      gpu(r).Use();
      CheckCuda(LaunchReduce(exchange(r, row_bytes, 2), dtype, K, mem[r].dest + n * M * K,
                             mem[r].combined + n * M * row_bytes, gpu(r).stream()),
                "LaunchReduce");
    }
    if (sync_each_phase) check_errors();
    // Redispatch of g with the scaled rows (combine's VJP).
    for (int64_t r = 0; r < R; ++r) {
      gpu(r).Use();
      const auto [send_slot, recv_item, recv_rows, row_slot, info, row_weights] = lay(r);
      CheckCuda(LaunchSendRows(exchange(r, row_bytes, 3), peers, mem[r].g + n * M * row_bytes,
                               row_bytes, send_slot, dtype, 0, gpu(r).stream()),
                "LaunchSendRows (g)");
    }
    for (int64_t r = 0; r < R; ++r) {
      gpu(r).Use();
      const auto [send_slot, recv_item, recv_rows, row_slot, info, row_weights] = lay(r);
      CheckCuda(
          LaunchPermuteScaled(exchange(r, row_bytes, 3), K, dtype, recv_rows, row_slot, info, fill,
                              mem[r].scale + n * C, mem[r].redispatched + n * C * row_bytes,
                              mem[r].scaled + n * C * row_bytes, gpu(r).stream()),
          "LaunchPermuteScaled");
    }
    if (sync_each_phase) check_errors();
  }
  check_errors();
  // [N, R, per] outputs from each rank's [N, per].
  auto gather = [&](auto member, size_t per, auto tag) {
    using T = decltype(tag);
    std::vector<T> out(N * R * per);
    for (int64_t r = 0; r < R; ++r) {
      const std::vector<T> part =
          gpu(r).Download(reinterpret_cast<const T*>(mem[r].*member), N * per);
      for (int64_t n = 0; n < N; ++n) {
        std::memcpy(out.data() + (n * R + r) * per, part.data() + n * per, per * sizeof(T));
      }
    }
    return out;
  };
  const size_t n = N, r = R, m = M, k = K, c = C, rb = row_bytes, orb = out_row_bytes;
  const size_t smp = mp, snp = np;
  nb::dict out;
  out["send_slot"] = ToNumpy(gather(&RankMemory::send_slot, smp * r, int32_t()), {n, r, smp, r});
  out["recv_item"] = ToNumpy(gather(&RankMemory::recv_item, snp, int32_t()), {n, r, snp});
  out["recv_rows"] = ToNumpy(gather(&RankMemory::recv_rows, snp * k, int32_t()), {n, r, snp, k});
  out["row_slot"] = ToNumpy(gather(&RankMemory::row_slot, c, int32_t()), {n, r, c});
  out["info"] = ToNumpy(gather(&RankMemory::info, 2, int32_t()), {n, r, 2});
  out["weights"] = ToNumpy(gather(&RankMemory::row_weights, c, float()), {n, r, c});
  out["tokens"] = ToNumpy(gather(&RankMemory::tokens, c * orb, uint8_t()), {n, r, c, orb});
  out["combined"] = ToNumpy(gather(&RankMemory::combined, m * rb, uint8_t()), {n, r, m, rb});
  out["redispatched"] =
      ToNumpy(gather(&RankMemory::redispatched, c * rb, uint8_t()), {n, r, c, rb});
  out["scaled"] = ToNumpy(gather(&RankMemory::scaled, c * rb, uint8_t()), {n, r, c, rb});
  return out;
}

}  // namespace

void RegisterTransportHarness(nb::module_& m) {
  m.def("cuda_selftest_transport", &SelftestTransport, nb::arg("dtype"), nb::arg("rows"),
        nb::arg("x"), nb::arg("dest"), nb::arg("row_pos"), nb::arg("weights"), nb::arg("y"),
        nb::arg("y_weights").none(), nb::arg("g"), nb::arg("scale"), nb::arg("send_blocks"),
        nb::arg("fp8_hidden") = 0, nb::arg("zero_pad_multiple") = 0, nb::arg("timeout_ms") = 10000,
        nb::arg("mismatch_rank") = -1, nb::arg("silent_rank") = -1,
        nb::arg("per_rank_devices") = false, nb::arg("sync_each_phase") = true,
        "The transport with R ranks: N rounds (the inputs' leading dimension) of layout, dispatch "
        "(FP8 with fp8_hidden), combine and redispatch (scaled) on the same windows; all on this "
        "GPU's one stream, or (per_rank_devices) rank r on device r with its own stream, the "
        "the caller waiting after every phase or (sync_each_phase=False) only at the end. "
        "mismatch_rank tags that rank's flags with another call site, silent_rank sends nothing "
        "(each must fail with ValueError). Returns a dict of [N, R, ...] results.");
}

}  // namespace jax_hybridep
