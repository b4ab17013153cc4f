// Transport v2's virtual-rank harness (v2_hooks.h): R ranks of one level on this one GPU, each
// with its own window, running the kernels of the FFI handlers (layout, send, permute, unpermute,
// send back, reduce) with nothing but the flags between ranks. The sends never wait, so every
// exchange enqueues all ranks' sends before any rank's receive on one stream: every rank's wide
// receive then finds its peers' flags raised or coming (no residency needed, unlike v1's
// cooperative harness). Rounds reuse the windows, so both halves and the exchange counters are
// exercised; a rank can be made to tag its flags with another call site (the waits must report a
// mismatch) or to send nothing (they must time out).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/string.h"
#include "xla_ffi/cuda/testing/hook_support.h"
#include "xla_ffi/cuda/testing/v2_hooks.h"
#include "xla_ffi/cuda/v2_layout.h"
#include "xla_ffi/cuda/v2_transport.h"
#include "xla_ffi/fp8.h"

namespace jax_hybridep {
namespace {

// One rank's layout outputs on the device.
struct RankLayout {
  int32_t *send_slot, *recv_item, *recv_rows, *row_slot, *info;
  float* row_weights;
};

std::string FailureMessage(const TransportError& e) {
  std::string what =
      e.code == kV2Mismatch ? "found a flag of another exchange (mismatch)" : "timed out";
  return "v2 exchange " + std::to_string(e.generation) + ": rank " + std::to_string(e.rank) +
         " waiting for rank " + std::to_string(e.peer) + " block " + std::to_string(e.block) + " " +
         what + "; flag " + std::to_string(e.seen) + ", expected " + std::to_string(e.expected);
}

nb::dict SelftestV2Transport(const std::string& dtype_name, int64_t rows, HostArray<uint8_t> x,
                             HostArray<int32_t> dest, HostArray<int32_t> row_pos,
                             HostArray<float> weights, HostArray<uint8_t> y,
                             std::optional<HostArray<float>> y_weights, HostArray<uint8_t> g,
                             HostArray<float> scale, int64_t send_blocks, int64_t fp8_hidden,
                             int64_t zero_pad_multiple, int64_t timeout_ms, int64_t mismatch_rank,
                             int64_t silent_rank) {
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

  GpuSession gpu;
  cudaStream_t stream = gpu.stream();
  const int64_t dispatch_bytes = fp8_hidden > 0 ? Fp8WireBytes(fp8_hidden) : x_row_bytes;
  const WindowGeometry geometry{R, M, 0, std::max(dispatch_bytes, row_bytes)};
  const V2WindowLayout layout = V2Layout(geometry);
  V2Peers peers{};
  for (int64_t r = 0; r < R; ++r) peers.base[r] = gpu.Zeros<char>(layout.total);
  void* host_error = nullptr;
  CheckCuda(cudaHostAlloc(&host_error, sizeof(TransportError) * R, cudaHostAllocMapped),
            "cudaHostAlloc");
  std::unique_ptr<void, cudaError_t (*)(void*)> host_error_owner(host_error, cudaFreeHost);
  std::memset(host_error, 0, sizeof(TransportError) * R);
  void* mapped_error = nullptr;
  CheckCuda(cudaHostGetDevicePointer(&mapped_error, host_error, 0), "cudaHostGetDevicePointer");
  auto exchange = [&](int64_t r, int64_t bytes, uint32_t site) {
    V2Exchange ex{};
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
    CheckCuda(cudaStreamSynchronize(stream), "v2 kernels");
    for (int64_t r = 0; r < R; ++r) {
      const TransportError e = static_cast<const TransportError*>(host_error)[r];
      Require(e.code == 0, FailureMessage(e));
    }
  };

  auto up = [&](const auto& a) { return gpu.Upload(a.data(), a.size()); };
  const char* d_x = reinterpret_cast<const char*>(up(x));
  const char* d_y = reinterpret_cast<const char*>(up(y));
  const char* d_g = reinterpret_cast<const char*>(up(g));
  const int32_t* d_dest = up(dest);
  const float* d_scale = up(scale);
  const float* d_y_weights = y_weights ? up(*y_weights) : nullptr;
  std::vector<int32_t> ranks(R);
  for (int64_t r = 0; r < R; ++r) ranks[r] = static_cast<int32_t>(r);
  const int32_t* d_ranks = gpu.Upload(ranks.data(), R);

  const int64_t mp = V2Padded(M), np = V2Padded(R * M);
  const int64_t out_row_bytes = fp8_hidden > 0 ? fp8_hidden * DtypeBytes(dtype) : x_row_bytes;
  // Per (round, rank) outputs.
  int32_t* send_slot = gpu.Zeros<int32_t>(N * R * mp * R);
  int32_t* recv_item = gpu.Zeros<int32_t>(N * R * np);
  int32_t* recv_rows = gpu.Zeros<int32_t>(N * R * np * K);
  int32_t* row_slot = gpu.Zeros<int32_t>(N * R * C);
  int32_t* info = gpu.Zeros<int32_t>(N * R * 2);
  float* row_weights = gpu.Zeros<float>(N * R * C);
  char* tokens = gpu.Zeros<char>(N * R * C * out_row_bytes);
  char* combined = gpu.Zeros<char>(N * R * M * row_bytes);
  char* redispatched = gpu.Zeros<char>(N * R * C * row_bytes);
  char* scaled = gpu.Zeros<char>(N * R * C * row_bytes);
  char* partials = gpu.Zeros<char>(R * np * row_bytes);
  const V2LayoutShape shape{R, M, K, C};
  char* workspace = gpu.Zeros<char>(V2LayoutWorkspaceBytes(shape));
  int32_t* gathered = gpu.Zeros<int32_t>(R * M * K * 3);
  const V2Fill fill{C, zero_pad_multiple};

  for (int64_t n = 0; n < N; ++n) {
    // The level's routing as the all-gather brings it: (destination, row, weight bits).
    std::vector<int32_t> host(R * M * K * 3);
    for (int64_t i = 0; i < R * M * K; ++i) {
      const int64_t at = n * R * M * K + i;
      host[3 * i] = dest.data()[at];
      host[3 * i + 1] = row_pos.data()[at];
      std::memcpy(&host[3 * i + 2], &weights.data()[at], 4);
    }
    CheckCuda(
        cudaMemcpyAsync(gathered, host.data(), host.size() * 4, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync");
    std::vector<RankLayout> lay(R);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = n * R + r;
      lay[r] = RankLayout{send_slot + at * mp * R, recv_item + at * np, recv_rows + at * np * K,
                          row_slot + at * C,       info + at * 2,       row_weights + at * C};
      CheckCuda(LaunchV2Layout(shape, d_ranks + r, gathered, lay[r].send_slot, lay[r].recv_item,
                               lay[r].recv_rows, lay[r].row_weights, lay[r].row_slot, lay[r].info,
                               workspace, stream),
                "LaunchV2Layout");
    }
    // Dispatch: every rank's send, then every rank's permute.
    const int64_t rm = (n * R) * M;
    for (int64_t r = 0; r < R; ++r) {
      if (r == silent_rank) continue;
      CheckCuda(
          LaunchV2SendRows(exchange(r, dispatch_bytes, 1), peers, d_x + (rm + r * M) * x_row_bytes,
                           x_row_bytes, lay[r].send_slot, dtype, fp8_hidden, stream),
          "LaunchV2SendRows");
    }
    for (int64_t r = 0; r < R; ++r) {
      CheckCuda(
          LaunchV2Permute(exchange(r, dispatch_bytes, 1), K, lay[r].recv_rows, lay[r].row_slot,
                          lay[r].info, fill, tokens + (n * R + r) * C * out_row_bytes,
                          out_row_bytes, dtype, fp8_hidden, stream),
          "LaunchV2Permute");
    }
    check_errors();
    // Combine: unpermute locally, send the partials back, reduce.
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = n * R + r;
      CheckCuda(LaunchV2Unpermute(dtype, hidden, K, d_y + at * C * row_bytes,
                                  d_y_weights ? d_y_weights + at * C : nullptr, lay[r].recv_rows,
                                  lay[r].info, np, partials + r * np * row_bytes, stream),
                "LaunchV2Unpermute");
    }
    for (int64_t r = 0; r < R; ++r) {
      CheckCuda(
          LaunchV2SendPartials(exchange(r, row_bytes, 2), peers, partials + r * np * row_bytes,
                               lay[r].recv_item, lay[r].info, stream),
          "LaunchV2SendPartials");
    }
    for (int64_t r = 0; r < R; ++r) {
      CheckCuda(LaunchV2Reduce(exchange(r, row_bytes, 2), dtype, K, d_dest + (rm + r * M) * K,
                               combined + (rm + r * M) * row_bytes, stream),
                "LaunchV2Reduce");
    }
    check_errors();
    // Redispatch of g with the scaled rows (combine's VJP).
    for (int64_t r = 0; r < R; ++r) {
      CheckCuda(LaunchV2SendRows(exchange(r, row_bytes, 3), peers, d_g + (rm + r * M) * row_bytes,
                                 row_bytes, lay[r].send_slot, dtype, 0, stream),
                "LaunchV2SendRows (g)");
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = n * R + r;
      CheckCuda(LaunchV2PermuteScaled(exchange(r, row_bytes, 3), K, dtype, lay[r].recv_rows,
                                      lay[r].row_slot, lay[r].info, fill, d_scale + at * C,
                                      redispatched + at * C * row_bytes,
                                      scaled + at * C * row_bytes, stream),
                "LaunchV2PermuteScaled");
    }
    check_errors();
  }
  auto bytes = [&](const char* device, size_t count) {
    const std::vector<char> h = gpu.Download(device, count);
    return std::vector<uint8_t>(h.begin(), h.end());
  };
  const size_t n = N, r = R, m = M, k = K, c = C, rb = row_bytes, orb = out_row_bytes;
  const size_t smp = mp, snp = np;
  nb::dict out;
  out["send_slot"] = ToNumpy(gpu.Download(send_slot, n * r * smp * r), {n, r, smp, r});
  out["recv_item"] = ToNumpy(gpu.Download(recv_item, n * r * snp), {n, r, snp});
  out["recv_rows"] = ToNumpy(gpu.Download(recv_rows, n * r * snp * k), {n, r, snp, k});
  out["row_slot"] = ToNumpy(gpu.Download(row_slot, n * r * c), {n, r, c});
  out["info"] = ToNumpy(gpu.Download(info, n * r * 2), {n, r, 2});
  out["weights"] = ToNumpy(gpu.Download(row_weights, n * r * c), {n, r, c});
  out["tokens"] = ToNumpy(bytes(tokens, n * r * c * orb), {n, r, c, orb});
  out["combined"] = ToNumpy(bytes(combined, n * r * m * rb), {n, r, m, rb});
  out["redispatched"] = ToNumpy(bytes(redispatched, n * r * c * rb), {n, r, c, rb});
  out["scaled"] = ToNumpy(bytes(scaled, n * r * c * rb), {n, r, c, rb});
  return out;
}

}  // namespace

void RegisterCudaV2Harness(nb::module_& m) {
  m.def("cuda_selftest_v2_transport", &SelftestV2Transport, nb::arg("dtype"), nb::arg("rows"),
        nb::arg("x"), nb::arg("dest"), nb::arg("row_pos"), nb::arg("weights"), nb::arg("y"),
        nb::arg("y_weights").none(), nb::arg("g"), nb::arg("scale"), nb::arg("send_blocks"),
        nb::arg("fp8_hidden") = 0, nb::arg("zero_pad_multiple") = 0, nb::arg("timeout_ms") = 10000,
        nb::arg("mismatch_rank") = -1, nb::arg("silent_rank") = -1,
        "Transport v2 with R virtual ranks on this GPU: N rounds (the inputs' leading dimension) "
        "of layout, dispatch (FP8 with fp8_hidden), combine and redispatch (scaled) on the same "
        "windows. mismatch_rank tags that rank's flags with another call site, silent_rank sends "
        "nothing (each must fail with ValueError). Returns a dict of [N, R, ...] results.");
}

}  // namespace jax_hybridep
