// Benchmark hook of the GPU transport: one rank running alone (its window on its own GPU, so
// every byte goes through HBM), timed with CUDA events per phase and per SM count (16-bit and FP8
// dispatch, combine), beside the layout kernels and a device-to-device copy of the same machine
// (python -m jax_hybridep.bench.gpu_transport prints and records the table).
#include "xla_ffi/cuda/testing/bench_hooks.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla_ffi/cuda/layout_kernels.h"
#include "xla_ffi/cuda/testing/hook_support.h"
#include "xla_ffi/cuda/transport.h"
#include "xla_ffi/fp8.h"
#include "xla_ffi/layout.h"

namespace jax_hybridep {
namespace {

// Times enqueued work on one stream with events; returns the median of the recorded samples.
class EventTimer {
 public:
  explicit EventTimer(cudaStream_t stream) : stream_(stream) {
    CheckCuda(cudaEventCreate(&start_), "cudaEventCreate");
    CheckCuda(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  template <typename Work>
  float Milliseconds(Work&& work) {
    CheckCuda(cudaEventRecord(start_, stream_), "cudaEventRecord");
    work();
    CheckCuda(cudaEventRecord(stop_, stream_), "cudaEventRecord");
    CheckCuda(cudaEventSynchronize(stop_), "timed kernels");
    float ms = 0;
    CheckCuda(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
    return ms;
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

nb::dict BenchTransport(const std::string& dtype_name, int64_t tokens, int64_t hidden, int64_t k,
                        int64_t num_experts, std::vector<int64_t> sms, int64_t iters,
                        int64_t warmup, int64_t copy_bytes) {
  const Dtype dtype = ParseDtype(dtype_name);
  Require(tokens > 0 && hidden > 0 && k > 0 && k <= num_experts && iters > 0 && warmup >= 0,
          "need tokens, hidden, iters > 0 and 0 < k <= num_experts");
  for (int64_t s : sms) {
    Require(s >= 1 && s <= kMaxSendBlocks, "sms values must be in [1, 256]");
  }
  const int64_t T = tokens, K = k, E = num_experts;
  const int64_t row_bytes = hidden * DtypeBytes(dtype);
  const int64_t C = T * K;  // dropless, one rank: every expert is local

  // Uniform routing: K distinct experts per token.
  std::mt19937_64 rng(1234);
  std::vector<int32_t> idx(T * K), experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    std::copy_n(experts.begin(), K, idx.begin() + t * K);
  }
  std::vector<int64_t> placement_rank(E, 0), placement_slot(E);
  std::iota(placement_slot.begin(), placement_slot.end(), 0);
  const Placement host_placement{placement_rank.data(), placement_slot.data(), E, 1, E};
  const CapacityPlan plan{-1, C, 1};
  std::vector<int32_t> counts(E), keep(E), offset(E), sizes(E), tpe(E), row_pos(T * K);
  CountRows(idx.data(), T, K, E, counts.data());
  PlanGroups(counts.data(), host_placement, plan, keep.data(), offset.data(), sizes.data(),
             tpe.data());
  AssignRows(idx.data(), T, K, 0, counts.data(), host_placement, keep.data(), offset.data(),
             row_pos.data());
  std::vector<int32_t> dest(T * K);
  for (int64_t i = 0; i < T * K; ++i) dest[i] = row_pos[i] >= 0 ? 0 : -1;
  std::vector<float> weights(T * K, 0.5f), row_weights(C, 0.25f);

  GpuSession gpu;
  cudaStream_t s = gpu.stream();
  EventTimer timer(s);
  std::vector<uint16_t> pattern(std::max<int64_t>(T, C) * row_bytes / 2);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint16_t>(0x3c00 + i % 977);
  const char* x = gpu.Upload(reinterpret_cast<const char*>(pattern.data()), T * row_bytes);
  const char* y = gpu.Upload(reinterpret_cast<const char*>(pattern.data()), C * row_bytes);
  const int32_t* d_idx = gpu.Upload(idx.data(), T * K);
  const int32_t* d_row_pos = gpu.Upload(row_pos.data(), T * K);
  const int32_t* d_dest = gpu.Upload(dest.data(), T * K);
  const float* d_weights = gpu.Upload(weights.data(), T * K);
  const float* d_row_weights = gpu.Upload(row_weights.data(), C);
  char* out_tokens = gpu.Zeros<char>(C * row_bytes);
  float* out_weights = gpu.Zeros<float>(C);
  int32_t* recv_row_pos = gpu.Zeros<int32_t>(T * K);
  char* combined = gpu.Zeros<char>(T * row_bytes);
  char* fp8_tokens = gpu.Zeros<char>(C * row_bytes);

  // FP8 dispatch moves wire rows (fp8.h) through the same window.
  const int64_t wire_bytes = Fp8WireBytes(hidden);
  const WindowGeometry geometry{1, T, K, std::max(row_bytes, wire_bytes)};
  const Window window = CarveWindow(gpu.Zeros<char>(WindowBytes(geometry)), geometry);
  const Window* d_window = gpu.Upload(&window, 1);
  TransportError* error = gpu.Zeros<TransportError>(1);
  uint64_t generation = 0;
  auto context = [&](int64_t blocks, int64_t bytes) {
    return ExchangeContext{d_window,
                           1,
                           T,
                           K,
                           bytes,
                           0,
                           ++generation,
                           static_cast<int32_t>(blocks),
                           int64_t{10} * 1000000000,
                           error};
  };

  nb::dict out;
  std::vector<double> send_us, receive_us, partials_us, reduce_us, fp8_send_us, fp8_receive_us;
  for (int64_t blocks : sms) {
    std::vector<double> a, b, c, d, e, f;
    for (int64_t i = 0; i < warmup + iters; ++i) {
      const ExchangeContext dispatch = context(blocks, row_bytes);
      const double t_send = timer.Milliseconds([&] {
        CheckCuda(LaunchSendTokens(dispatch, x, d_dest, d_row_pos, d_weights, s), "send");
      });
      const double t_receive = timer.Milliseconds([&] {
        CheckCuda(LaunchReceiveRows(dispatch, out_tokens, out_weights, recv_row_pos, C, s),
                  "receive");
      });
      const ExchangeContext combine = context(blocks, row_bytes);
      const double t_partials = timer.Milliseconds([&] {
        CheckCuda(LaunchSendPartials(combine, dtype, y, d_row_weights, recv_row_pos, s),
                  "partials");
      });
      const double t_reduce = timer.Milliseconds(
          [&] { CheckCuda(LaunchReducePartials(combine, dtype, d_dest, combined, s), "reduce"); });
      const ExchangeContext fp8 = context(blocks, wire_bytes);
      const double t_fp8_send = timer.Milliseconds([&] {
        CheckCuda(LaunchSendTokensQuantized(fp8, dtype, hidden, x, d_dest, d_row_pos, d_weights, s),
                  "FP8 send");
      });
      const double t_fp8_receive = timer.Milliseconds([&] {
        CheckCuda(LaunchReceiveRowsDequantized(fp8, dtype, hidden, fp8_tokens, out_weights,
                                               recv_row_pos, C, s),
                  "FP8 receive");
      });
      if (i < warmup) continue;
      a.push_back(t_send * 1e3), b.push_back(t_receive * 1e3);
      c.push_back(t_partials * 1e3), d.push_back(t_reduce * 1e3);
      e.push_back(t_fp8_send * 1e3), f.push_back(t_fp8_receive * 1e3);
    }
    send_us.push_back(Median(a)), receive_us.push_back(Median(b));
    partials_us.push_back(Median(c)), reduce_us.push_back(Median(d));
    fp8_send_us.push_back(Median(e)), fp8_receive_us.push_back(Median(f));
  }
  const std::vector<TransportError> errors = gpu.Download(error, 1);
  Require(errors[0].code == 0, "a transport wait timed out during the benchmark");

  // The FP8 rows timed above are the host row kernels' bits (fp8.cc): the figures are of a
  // dispatch that computes the right thing.
  const std::vector<char> got = gpu.Download(fp8_tokens, C * row_bytes);
  std::vector<uint8_t> wire(wire_bytes);
  std::vector<char> want(row_bytes);
  const char* host_x = reinterpret_cast<const char*>(pattern.data());
  for (int64_t t = 0; t < T; ++t) {
    QuantizeRow(host_x + t * row_bytes, hidden, dtype, wire.data());
    DequantizeRow(wire.data(), hidden, dtype, want.data());
    for (int64_t j = 0; j < K; ++j) {
      const int32_t row = row_pos[t * K + j];
      Require(row < 0 || std::equal(want.begin(), want.end(), got.begin() + row * row_bytes),
              "the CUDA FP8 dispatch disagrees with the host row kernels");
    }
  }

  // Layout: the handler's plan and assignment over the (here trivially gathered) counts, which XLA
  // counts and all-gathers in production.
  const Placement placement{gpu.Upload(placement_rank.data(), E),
                            gpu.Upload(placement_slot.data(), E), E, 1, E};
  const int32_t* d_counts = gpu.Upload(counts.data(), E);
  int32_t *d_keep = gpu.Zeros<int32_t>(E), *d_offset = gpu.Zeros<int32_t>(E);
  int32_t *d_sizes = gpu.Zeros<int32_t>(E), *d_tpe = gpu.Zeros<int32_t>(E);
  int32_t* d_assigned = gpu.Zeros<int32_t>(T * K);
  int64_t* d_dropped = gpu.Zeros<int64_t>(1);
  const size_t workspace_bytes = AssignRowsWorkspaceBytes(T, K, E);
  char* workspace = gpu.Zeros<char>(workspace_bytes);
  std::vector<double> layout_us;
  for (int64_t i = 0; i < warmup + iters; ++i) {
    const double ms = timer.Milliseconds([&] {
      CheckCuda(LaunchPlanGroups(d_counts, placement, plan, d_keep, d_offset, d_sizes, d_tpe, s),
                "plan");
      CheckCuda(LaunchAssignRows(d_idx, T, K, 0, d_counts, placement, d_keep, d_offset, d_assigned,
                                 d_dropped, workspace, workspace_bytes, s),
                "assign");
    });
    if (i >= warmup) layout_us.push_back(ms * 1e3);
  }
  const std::vector<int32_t> assigned = gpu.Download(d_assigned, T * K);
  Require(assigned == row_pos, "the CUDA layout disagrees with the host layout");

  // The machine's device-to-device copy, for the HBM reference.
  char* copy_src = gpu.Zeros<char>(copy_bytes);
  char* copy_dst = gpu.Zeros<char>(copy_bytes);
  std::vector<double> copy_us;
  for (int64_t i = 0; i < warmup + iters; ++i) {
    const double ms = timer.Milliseconds([&] {
      CheckCuda(cudaMemcpyAsync(copy_dst, copy_src, copy_bytes, cudaMemcpyDeviceToDevice, s),
                "cudaMemcpyAsync");
    });
    if (i >= warmup) copy_us.push_back(ms * 1e3);
  }

  out["sms"] = sms;
  out["dispatch_send_us"] = send_us;
  out["dispatch_receive_us"] = receive_us;
  out["combine_send_us"] = partials_us;
  out["combine_reduce_us"] = reduce_us;
  out["fp8_send_us"] = fp8_send_us;
  out["fp8_receive_us"] = fp8_receive_us;
  out["fp8_row_bytes"] = wire_bytes;
  out["layout_us"] = Median(layout_us);
  out["copy_us"] = Median(copy_us);
  out["copy_bytes"] = copy_bytes;
  out["rows"] = C;
  out["row_bytes"] = row_bytes;
  out["tokens"] = T;
  return out;
}

}  // namespace

void RegisterCudaBench(nb::module_& m) {
  m.def("cuda_bench_transport", &BenchTransport, nb::arg("dtype"), nb::arg("tokens"),
        nb::arg("hidden"), nb::arg("k"), nb::arg("num_experts"), nb::arg("sms"),
        nb::arg("iters") = 20, nb::arg("warmup") = 3, nb::arg("copy_bytes") = int64_t{1} << 30,
        "Median microseconds of the transport's phases for one rank alone (16-bit and FP8 "
        "dispatch, combine), per SM count, of the layout kernels, and of a device-to-device copy "
        "of copy_bytes. Returns a dict.");
}

}  // namespace jax_hybridep
