// Benchmark hooks of the GPU checks for the transport (hooks.h), timed with CUDA events (the
// median of `iters` samples after `warmup`):
//   cuda_bench_copy_ceiling  C_sm: a copy through 16-byte LSU accesses against the bulk-copy
//                            engine, per block count;
//   cuda_bench_transport     one rank alone (its window on its own GPU, so every byte goes
//                            through HBM): the slot map, the send (16-bit and FP8) and combine's
//                            send back per SM count, the wide permute, unpermute and reduce,
//                            beside a device-to-device copy; the rows are checked against the
//                            references before any figure is returned;
//   cuda_send_kernel_info    the loaded send kernel's registers and shared memory.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "lab/native/cuda/copy_ceiling.h"
#include "lab/native/cuda/hook_support.h"
#include "lab/native/cuda/hooks.h"
#include "lab/native/cuda/introspection.h"
#include "lab/native/cuda/reference.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla_ffi/common/fp8.h"
#include "xla_ffi/cuda/kernels/slot_map.h"
#include "xla_ffi/cuda/kernels/transport.h"

namespace jax_hybridep {
namespace {

// Median microseconds of `work` enqueued on `stream`, over `iters` samples after `warmup`.
class Timer {
 public:
  explicit Timer(cudaStream_t stream) : stream_(stream) {
    CheckCuda(cudaEventCreate(&start_), "cudaEventCreate");
    CheckCuda(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  template <typename Work>
  double Us(Work&& work) {
    CheckCuda(cudaEventRecord(start_, stream_), "cudaEventRecord");
    work();
    CheckCuda(cudaEventRecord(stop_, stream_), "cudaEventRecord");
    CheckCuda(cudaEventSynchronize(stop_), "timed kernels");
    float ms = 0;
    CheckCuda(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
    return ms * 1e3;
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

nb::dict BenchCopyCeiling(int64_t bytes, std::vector<int64_t> blocks, int64_t iters,
                          int64_t warmup) {
  Require(bytes > 0 && bytes % 16 == 0 && iters > 0 && warmup >= 0,
          "need bytes a positive multiple of 16, iters > 0, warmup >= 0");
  GpuSession gpu;
  cudaStream_t s = gpu.stream();
  std::vector<uint8_t> pattern(1 << 20);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 131 + 7);
  char* src = gpu.Zeros<char>(bytes);
  char* dst = gpu.Zeros<char>(bytes);
  for (int64_t at = 0; at < bytes; at += pattern.size()) {
    CheckCuda(
        cudaMemcpyAsync(src + at, pattern.data(), std::min<int64_t>(pattern.size(), bytes - at),
                        cudaMemcpyHostToDevice, s),
        "cudaMemcpyAsync");
  }
  Timer timer(s);
  nb::dict out;
  for (CopyPath path : {CopyPath::kLsu, CopyPath::kBulk}) {
    std::vector<double> medians;
    for (int64_t b : blocks) {
      Require(b >= 1 && b <= 65535, "blocks must be in [1, 65535]");
      CheckCuda(cudaMemsetAsync(dst, 0, bytes, s), "cudaMemsetAsync");
      std::vector<double> samples;
      for (int64_t i = 0; i < warmup + iters; ++i) {
        const double us = timer.Us([&] {
          CheckCuda(LaunchCopyCeiling(path, src, dst, bytes, static_cast<int>(b), s), "copy");
        });
        if (i >= warmup) samples.push_back(us);
      }
      // The copy is a copy: its first and last MiB.
      const int64_t tail = std::max<int64_t>(0, bytes - static_cast<int64_t>(pattern.size()));
      const std::vector<char> head = gpu.Download(dst, std::min<int64_t>(bytes, pattern.size()));
      Require(std::memcmp(head.data(), pattern.data(), head.size()) == 0,
              "the copy-ceiling kernel did not copy");
      const std::vector<char> end = gpu.Download(dst + tail, bytes - tail);
      const std::vector<char> src_end = gpu.Download(src + tail, bytes - tail);
      Require(end == src_end, "the copy-ceiling kernel did not copy the end");
      medians.push_back(Median(samples));
    }
    out[path == CopyPath::kLsu ? "lsu_us" : "bulk_us"] = medians;
  }
  out["blocks"] = blocks;
  out["bytes"] = bytes;
  return out;
}

nb::dict BenchTransport(const std::string& dtype_name, int64_t tokens, int64_t hidden, int64_t k,
                        int64_t num_experts, std::vector<int64_t> sms, int64_t iters,
                        int64_t warmup, int64_t copy_bytes) {
  const Dtype dtype = ParseDtype(dtype_name);
  Require(tokens > 0 && hidden > 0 && k > 0 && k <= num_experts && k <= kMaxTopK && iters > 0 &&
              warmup >= 0,
          "need tokens, hidden, iters > 0 and 0 < k <= min(num_experts, 64)");
  for (int64_t s : sms) Require(s >= 1 && s <= kMaxSendBlocks, "sms values must be in [1, 256]");
  const int64_t T = tokens, K = k, E = num_experts, C = T * K;  // dropless, every expert here
  const int64_t row_bytes = hidden * DtypeBytes(dtype), wire_bytes = Fp8WireBytes(hidden);

  // Uniform routing: K distinct experts per token, rows in (t, k) order within each expert.
  std::mt19937_64 rng(1234);
  std::vector<int32_t> experts(E), idx(T * K);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    std::copy_n(experts.begin(), K, idx.begin() + t * K);
  }
  std::vector<int64_t> per_expert(E, 0), start(E, 0);
  for (int32_t e : idx) ++per_expert[e];
  for (int64_t e = 1; e < E; ++e) start[e] = start[e - 1] + per_expert[e - 1];
  std::vector<int32_t> gathered(T * K * 3);
  for (int64_t i = 0; i < T * K; ++i) {
    const float w = 0.25f + static_cast<float>(i % 7);
    gathered[3 * i] = 0;
    gathered[3 * i + 1] = static_cast<int32_t>(start[idx[i]]++);
    std::memcpy(&gathered[3 * i + 2], &w, 4);
  }
  const SlotMapShape shape{1, T, K, C};
  const int64_t mp = ChunkPadded(T), np = ChunkPadded(T);

  GpuSession gpu;
  cudaStream_t s = gpu.stream();
  Timer timer(s);
  std::vector<uint16_t> pattern(std::max(T, C) * row_bytes / 2);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint16_t>(0x3c00 + i % 977);
  const char* x = gpu.Upload(reinterpret_cast<const char*>(pattern.data()), T * row_bytes);
  const char* y = gpu.Upload(reinterpret_cast<const char*>(pattern.data()), C * row_bytes);
  const int32_t zero = 0;
  const int32_t* d_rank = gpu.Upload(&zero, 1);
  const int32_t* d_gathered = gpu.Upload(gathered.data(), gathered.size());
  std::vector<int32_t> dest(T * K, 0);
  const int32_t* d_dest = gpu.Upload(dest.data(), dest.size());
  int32_t* send_slot = gpu.Zeros<int32_t>(mp);
  int32_t* recv_item = gpu.Zeros<int32_t>(np);
  int32_t* recv_rows = gpu.Zeros<int32_t>(np * K);
  int32_t* row_slot = gpu.Zeros<int32_t>(C);
  int32_t* info = gpu.Zeros<int32_t>(2);
  float* row_weights = gpu.Zeros<float>(C);
  char* workspace = gpu.Zeros<char>(SlotMapWorkspaceBytes(shape));
  char* out = gpu.Zeros<char>(C * row_bytes);
  char* fp8_out = gpu.Zeros<char>(C * row_bytes);
  char* partials = gpu.Zeros<char>(np * row_bytes);
  char* combined = gpu.Zeros<char>(T * row_bytes);

  std::vector<double> layout_us;
  for (int64_t i = 0; i < warmup + iters; ++i) {
    const double us = timer.Us([&] {
      CheckCuda(LaunchSlotMap(shape, d_rank, d_gathered, send_slot, recv_item, recv_rows,
                              row_weights, row_slot, info, workspace, s),
                "layout");
    });
    if (i >= warmup) layout_us.push_back(us);
  }

  const WindowGeometry geometry{1, T, std::max(row_bytes, wire_bytes)};
  PeerWindows peers{};
  peers.base[0] = gpu.Zeros<char>(WindowBytes(geometry));
  TransportError* error = gpu.Zeros<TransportError>(1);
  auto exchange = [&](int64_t blocks, int64_t bytes, uint32_t site) {
    ExchangeParams ex{};
    ex.window = WindowRegionsFor(geometry);
    ex.own = peers.base[0];
    ex.ranks = 1;
    ex.rank = 0;
    ex.items = T;
    ex.row_bytes = bytes;
    ex.send_blocks = static_cast<int32_t>(blocks);
    ex.site = site;
    ex.timeout_ns = int64_t{10} * 1000000000;
    ex.error = error;
    return ex;
  };
  const PaddingFill fill{C, 0};
  std::vector<double> send_us, permute_us, fp8_send_us, fp8_permute_us, unpermute_us, partials_us,
      reduce_us;
  for (int64_t blocks : sms) {
    std::vector<double> a, b, c, d, e, f, g;
    for (int64_t i = 0; i < warmup + iters; ++i) {
      const ExchangeParams dispatch = exchange(blocks, row_bytes, 1);
      const double t_send = timer.Us([&] {
        CheckCuda(LaunchSendRows(dispatch, peers, x, row_bytes, send_slot, dtype, 0, s), "send");
      });
      const double t_permute = timer.Us([&] {
        CheckCuda(LaunchPermute(dispatch, K, recv_rows, row_slot, info, fill, out, row_bytes, dtype,
                                0, s),
                  "permute");
      });
      const ExchangeParams fp8 = exchange(blocks, wire_bytes, 2);
      const double t_fp8_send = timer.Us([&] {
        CheckCuda(LaunchSendRows(fp8, peers, x, row_bytes, send_slot, dtype, hidden, s),
                  "FP8 send");
      });
      const double t_fp8_permute = timer.Us([&] {
        CheckCuda(LaunchPermute(fp8, K, recv_rows, row_slot, info, fill, fp8_out, row_bytes, dtype,
                                hidden, s),
                  "FP8 permute");
      });
      const double t_unpermute = timer.Us([&] {
        CheckCuda(
            LaunchUnpermute(dtype, hidden, K, y, row_weights, recv_rows, info, np, partials, s),
            "unpermute");
      });
      const ExchangeParams combine = exchange(blocks, row_bytes, 3);
      const double t_partials = timer.Us([&] {
        CheckCuda(LaunchSendPartials(combine, peers, partials, recv_item, info, s), "partials");
      });
      const double t_reduce = timer.Us(
          [&] { CheckCuda(LaunchReduce(combine, dtype, K, d_dest, combined, s), "reduce"); });
      if (i < warmup) continue;
      a.push_back(t_send), b.push_back(t_permute), c.push_back(t_fp8_send);
      d.push_back(t_fp8_permute), e.push_back(t_unpermute), f.push_back(t_partials);
      g.push_back(t_reduce);
    }
    send_us.push_back(Median(a)), permute_us.push_back(Median(b));
    fp8_send_us.push_back(Median(c)), fp8_permute_us.push_back(Median(d));
    unpermute_us.push_back(Median(e)), partials_us.push_back(Median(f));
    reduce_us.push_back(Median(g));
  }
  const std::vector<TransportError> errors = gpu.Download(error, 1);
  Require(errors[0].code == 0, "a wait failed during the benchmark");

  // The figures are of exchanges that compute the right thing: rows and sums against the
  // references (reference.h) on the same metadata.
  std::vector<int32_t> ref_rows(np * K), ref_slot(C), ref_info(2), ref_send(mp), ref_item(np);
  std::vector<float> ref_weights(C);
  SlotMapReference(shape, 0, gathered.data(), ref_send.data(), ref_item.data(), ref_rows.data(),
                   ref_weights.data(), ref_slot.data(), ref_info.data());
  Require(gpu.Download(recv_rows, np * K) == ref_rows && gpu.Download(row_slot, C) == ref_slot &&
              gpu.Download(info, 2) == ref_info && gpu.Download(send_slot, mp) == ref_send,
          "the slot-map kernels disagree with the reference");
  const char* x_bytes = reinterpret_cast<const char*>(pattern.data());
  const int64_t stride = WindowRegionsFor(geometry).slot_stride;
  std::vector<char> slots(T * stride), wire(T * stride), want(C * row_bytes),
      want_fp8(C * row_bytes);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(slots.data() + t * stride, x_bytes + t * row_bytes, row_bytes);
    QuantizeRow(x_bytes + t * row_bytes, hidden, dtype,
                reinterpret_cast<uint8_t*>(wire.data() + t * stride));
  }
  PermuteReference(shape, slots.data(), stride, row_bytes, ref_rows.data(), ref_slot.data(),
                   ref_info.data(), 0, want.data(), dtype, 0, nullptr, nullptr);
  PermuteReference(shape, wire.data(), stride, wire_bytes, ref_rows.data(), ref_slot.data(),
                   ref_info.data(), 0, want_fp8.data(), dtype, hidden, nullptr, nullptr);
  Require(gpu.Download(out, C * row_bytes) == want, "the permute disagrees with the reference");
  Require(gpu.Download(fp8_out, C * row_bytes) == want_fp8,
          "the FP8 dispatch disagrees with the CPU row kernels");
  std::vector<char> want_partials(T * row_bytes), want_combined(T * row_bytes);
  UnpermuteReference(shape, dtype, hidden, reinterpret_cast<const char*>(pattern.data()),
                     ref_weights.data(), ref_rows.data(), ref_info.data(), want_partials.data());
  ReduceReference(shape, dtype, hidden, want_partials.data(), dest.data(), want_combined.data());
  Require(gpu.Download(combined, T * row_bytes) == want_combined,
          "the combine disagrees with the references");

  char* copy_src = gpu.Zeros<char>(copy_bytes);
  char* copy_dst = gpu.Zeros<char>(copy_bytes);
  std::vector<double> copy_us;
  for (int64_t i = 0; i < warmup + iters; ++i) {
    const double us = timer.Us([&] {
      CheckCuda(cudaMemcpyAsync(copy_dst, copy_src, copy_bytes, cudaMemcpyDeviceToDevice, s),
                "cudaMemcpyAsync");
    });
    if (i >= warmup) copy_us.push_back(us);
  }
  const SendPlan plan = PlanSend(row_bytes, 1, 0);
  nb::dict result;
  result["sms"] = sms;
  result["send_us"] = send_us;
  result["permute_us"] = permute_us;
  result["fp8_send_us"] = fp8_send_us;
  result["fp8_permute_us"] = fp8_permute_us;
  result["unpermute_us"] = unpermute_us;
  result["combine_send_us"] = partials_us;
  result["reduce_us"] = reduce_us;
  result["layout_us"] = Median(layout_us);
  result["copy_us"] = Median(copy_us);
  result["copy_bytes"] = copy_bytes;
  result["rows"] = C;
  result["row_bytes"] = row_bytes;
  result["fp8_row_bytes"] = wire_bytes;
  result["tokens"] = T;
  result["stages"] = plan.stages;
  result["smem_bytes"] = plan.smem_bytes;
  return result;
}

nb::dict KernelInfo() {
  if (CudaDeviceCount() == 0) throw std::runtime_error("no CUDA device available");
  int registers = 0;
  int64_t static_smem = 0, max_dynamic_smem = 0;
  CheckCuda(GetSendKernelInfo(&registers, &static_smem, &max_dynamic_smem), "GetSendKernelInfo");
  nb::dict out;
  out["registers"] = registers;
  out["static_smem"] = static_smem;
  out["max_dynamic_smem"] = max_dynamic_smem;
  return out;
}

}  // namespace

void RegisterTransportBench(nb::module_& m) {
  m.def("cuda_bench_copy_ceiling", &BenchCopyCeiling, nb::arg("bytes"), nb::arg("blocks"),
        nb::arg("iters") = 10, nb::arg("warmup") = 2,
        "Median microseconds of a copy of `bytes` by 16-byte LSU accesses (lsu_us) and by the "
        "bulk-copy engine (bulk_us), per block count. Returns a dict.");
  m.def("cuda_bench_transport", &BenchTransport, nb::arg("dtype"), nb::arg("tokens"),
        nb::arg("hidden"), nb::arg("k"), nb::arg("num_experts"), nb::arg("sms"),
        nb::arg("iters") = 20, nb::arg("warmup") = 3, nb::arg("copy_bytes") = int64_t{1} << 30,
        "Median microseconds of the transport's kernels for one rank alone (send, FP8 send and "
        "combine's send back per SM count; permute, FP8 permute, unpermute and reduce), of its "
        "layout and of a device-to-device copy of copy_bytes. Returns a dict.");
  m.def("cuda_send_kernel_info", &KernelInfo,
        "The loaded send kernel's registers and static shared memory, and the dynamic shared "
        "memory a block may opt into here.");
}

}  // namespace jax_hybridep
