// The virtual-rank harness (transport_harness.h): every rank of a window group on one GPU in one
// cooperative launch, blocks split by rank, running the same device phases as the per-rank
// kernels (transport_phases.cuh), so the protocol is tested on a single GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "xla_ffi/cuda/launch_support.h"
#include "xla_ffi/cuda/testing/transport_harness.h"
#include "xla_ffi/cuda/transport_phases.cuh"

namespace jax_hybridep {
namespace {

template <Dtype kDtype>
__device__ void HarnessRank(const ExchangeContext& ctx, int64_t block, const HarnessArgs& a) {
  const int64_t r = ctx.rank, T = ctx.tokens, K = ctx.k, R = ctx.ranks;
  const int64_t rb = ctx.row_bytes;
  const int32_t* dest = a.dest + r * T * K;
  int32_t* recv_row_pos = a.recv_row_pos + r * R * T * K;
  switch (a.exchange) {
    case HarnessExchange::kDispatch:
      SendTokensPhase(ctx, block, a.in_rows + r * T * rb, dest, a.row_pos + r * T * K,
                      a.in_values + r * T * K);
      ReceiveRowsPhase(ctx, block, a.out_rows + r * a.rows * rb, a.out_values + r * a.rows,
                       recv_row_pos, CopyRowsTo(ctx, a.out_rows + r * a.rows * rb));
      break;
    case HarnessExchange::kRedispatch:
      SendTokensPhase(ctx, block, a.in_rows + r * T * rb, dest, nullptr, nullptr);
      ReceiveRedispatchPhase<kDtype>(
          ctx, block, recv_row_pos, a.in_values == nullptr ? nullptr : a.in_values + r * a.rows,
          a.out_rows + r * a.rows * rb,
          a.out_scaled == nullptr ? nullptr : a.out_scaled + r * a.rows * rb);
      break;
    case HarnessExchange::kCombine:
      SendPartialsPhase<kDtype>(ctx, block, a.in_rows + r * a.rows * rb,
                                a.in_values == nullptr ? nullptr : a.in_values + r * a.rows,
                                recv_row_pos);
      ReducePartialsPhase<kDtype>(ctx, block, dest, a.out_rows + r * T * rb);
      break;
    case HarnessExchange::kRowValues:
      SendRowValuesPhase(ctx, block, a.in_values + r * a.rows, recv_row_pos);
      ReceiveRowValuesPhase(ctx, block, dest, a.out_values + r * T * K);
      break;
  }
}

template <Dtype kDtype>
__global__ void __launch_bounds__(kThreads)
    HarnessKernel(const ExchangeContext* contexts, int32_t blocks_per_rank, HarnessArgs args) {
  const ExchangeContext ctx = contexts[blockIdx.x / blocks_per_rank];
  HarnessRank<kDtype>(ctx, blockIdx.x % blocks_per_rank, args);
}

}  // namespace

cudaError_t HarnessResidentBlocks(int64_t ranks, int* blocks_per_rank) {
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t s = cudaGetDevice(&device);
  if (s == cudaSuccess) s = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  // The float32 instance stands for all: every instance has the same block shape and ring.
  if (s == cudaSuccess) {
    s = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, HarnessKernel<Dtype::kF32>, kThreads,
                                                      kRingBytes);
  }
  if (s != cudaSuccess) return s;
  *blocks_per_rank = static_cast<int>(std::min<int64_t>(
      kMaxSendBlocks, static_cast<int64_t>(sms) * per_sm / std::max<int64_t>(ranks, 1)));
  return cudaSuccess;
}

cudaError_t LaunchHarness(const ExchangeContext* contexts_device, int64_t ranks,
                          int32_t blocks_per_rank, const HarnessArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ranks * blocks_per_rank));
  HarnessArgs a = args;
  const ExchangeContext* contexts = contexts_device;
  int32_t bpr = blocks_per_rank;
  void* params[] = {&contexts, &bpr, &a};
  cudaError_t status = cudaSuccess;
  ByDtype(args.dtype, [&](auto d) {
    status = cudaLaunchCooperativeKernel(
        reinterpret_cast<const void*>(&HarnessKernel<decltype(d)::value>), grid, dim3(kThreads),
        params, kRingBytes, stream);
  });
  return status != cudaSuccess ? status : cudaGetLastError();
}

}  // namespace jax_hybridep
