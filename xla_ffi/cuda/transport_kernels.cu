// The direct-write transport's per-rank kernels and their launchers (transport.h): one kernel per
// phase (transport_phases.cuh), launched on XLA's stream by the FFI handlers, each returning the
// launch status without synchronising.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "xla_ffi/cuda/launch_support.h"
#include "xla_ffi/cuda/transport.h"
#include "xla_ffi/cuda/transport_phases.cuh"
#include "xla_ffi/fp8.h"

namespace jax_hybridep {
namespace {

// ----------------------------------------------------------------------------- per-rank kernels

__global__ void __launch_bounds__(kThreads)
    SendTokensKernel(ExchangeContext ctx, const char* x, const int32_t* dest,
                     const int32_t* row_pos, const float* weights) {
  SendTokensPhase(ctx, blockIdx.x, x, dest, row_pos, weights);
}

__global__ void __launch_bounds__(kThreads)
    ReceiveRowsKernel(ExchangeContext ctx, char* out_tokens, float* out_weights,
                      int32_t* recv_row_pos) {
  ReceiveRowsPhase(ctx, blockIdx.x, out_tokens, out_weights, recv_row_pos,
                   CopyRowsTo(ctx, out_tokens));
}

template <Dtype kDtype>
__global__ void __launch_bounds__(kThreads)
    SendTokensQuantizedKernel(ExchangeContext ctx, int64_t hidden, const char* x,
                              const int32_t* dest, const int32_t* row_pos, const float* weights) {
  SendTokensQuantizedPhase<kDtype>(ctx, blockIdx.x, hidden, x, dest, row_pos, weights);
}

template <Dtype kDtype>
__global__ void __launch_bounds__(kThreads)
    ReceiveRowsDequantizedKernel(ExchangeContext ctx, int64_t hidden, char* out_tokens,
                                 float* out_weights, int32_t* recv_row_pos) {
  ReceiveRowsPhase(ctx, blockIdx.x, out_tokens, out_weights, recv_row_pos,
                   DequantizeRows<kDtype>{hidden});
}

template <Dtype kDtype>
__global__ void __launch_bounds__(kThreads)
    ReceiveRedispatchKernel(ExchangeContext ctx, const int32_t* recv_row_pos, const float* scale,
                            char* out_tokens, char* out_scaled) {
  ReceiveRedispatchPhase<kDtype>(ctx, blockIdx.x, recv_row_pos, scale, out_tokens, out_scaled);
}

template <Dtype kDtype>
__global__ void PrefillRedispatchKernel(int64_t rows, int64_t row_bytes, const float* scale,
                                        char* out_tokens, char* out_scaled) {
  const int64_t hidden = row_bytes / DtypeBytes(kDtype);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      StoreFromFloat(out_tokens + row * row_bytes, h, 0.0f, kDtype);
      if (out_scaled != nullptr) {
        StoreFromFloat(out_scaled + row * row_bytes, h, __fmul_rn(0.0f, scale[row]), kDtype);
      }
    }
  }
}

template <Dtype kDtype>
__global__ void __launch_bounds__(kThreads)
    SendPartialsKernel(ExchangeContext ctx, const char* y, const float* weights,
                       const int32_t* recv_row_pos) {
  SendPartialsPhase<kDtype>(ctx, blockIdx.x, y, weights, recv_row_pos);
}

template <Dtype kDtype>
__global__ void __launch_bounds__(kThreads)
    ReducePartialsKernel(ExchangeContext ctx, const int32_t* dest, char* out) {
  ReducePartialsPhase<kDtype>(ctx, blockIdx.x, dest, out);
}

__global__ void __launch_bounds__(kThreads)
    SendRowValuesKernel(ExchangeContext ctx, const float* values, const int32_t* recv_row_pos) {
  SendRowValuesPhase(ctx, blockIdx.x, values, recv_row_pos);
}

__global__ void __launch_bounds__(kThreads)
    ReceiveRowValuesKernel(ExchangeContext ctx, const int32_t* dest, float* out) {
  ReceiveRowValuesPhase(ctx, blockIdx.x, dest, out);
}

// ----------------------------------------------------------------------------- launch helpers

dim3 SendGrid(const ExchangeContext& ctx) { return dim3(static_cast<unsigned>(ctx.send_blocks)); }

cudaError_t CheckContext(const ExchangeContext& ctx) {
  if (ctx.send_blocks < 1 || ctx.send_blocks > kMaxSendBlocks || ctx.ranks < 1 ||
      ctx.ranks > kMaxWindowRanks || ctx.k > kMaxTopK) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchSendTokens(const ExchangeContext& ctx, const char* x, const int32_t* dest,
                             const int32_t* row_pos, const float* weights, cudaStream_t stream) {
  if (cudaError_t s = CheckContext(ctx); s != cudaSuccess) return s;
  SendTokensKernel<<<SendGrid(ctx), kThreads, kRingBytes, stream>>>(ctx, x, dest, row_pos, weights);
  return cudaGetLastError();
}

cudaError_t LaunchSendTokensQuantized(const ExchangeContext& ctx, Dtype dtype, int64_t hidden,
                                      const char* x, const int32_t* dest, const int32_t* row_pos,
                                      const float* weights, cudaStream_t stream) {
  if (cudaError_t s = CheckContext(ctx); s != cudaSuccess) return s;
  if (ctx.row_bytes != Fp8WireBytes(hidden)) return cudaErrorInvalidValue;
  return ByDtype(dtype, [&](auto d) {
    SendTokensQuantizedKernel<decltype(d)::value>
        <<<SendGrid(ctx), kThreads, 0, stream>>>(ctx, hidden, x, dest, row_pos, weights);
  });
}

namespace {

// What every dispatch receive starts from: rows [C, out_row_bytes] and their weights zeroed, and
// the map all -1 (if a wait times out, the slots it never reached must not hand later exchanges
// garbage rows to index with; the error surfaces at the next call).
cudaError_t PrefillReceive(const ExchangeContext& ctx, char* out_tokens, int64_t out_row_bytes,
                           float* out_weights, int32_t* recv_row_pos, int64_t rows,
                           cudaStream_t stream) {
  if (cudaError_t s = CheckContext(ctx); s != cudaSuccess) return s;
  cudaError_t status = cudaMemsetAsync(out_tokens, 0, rows * out_row_bytes, stream);
  if (status == cudaSuccess) status = cudaMemsetAsync(out_weights, 0, rows * sizeof(float), stream);
  const size_t map_bytes = ctx.ranks * ctx.tokens * ctx.k * sizeof(int32_t);
  if (status == cudaSuccess) status = cudaMemsetAsync(recv_row_pos, 0xff, map_bytes, stream);
  return status;
}

}  // namespace

cudaError_t LaunchReceiveRows(const ExchangeContext& ctx, char* out_tokens, float* out_weights,
                              int32_t* recv_row_pos, int64_t rows, cudaStream_t stream) {
  cudaError_t status =
      PrefillReceive(ctx, out_tokens, ctx.row_bytes, out_weights, recv_row_pos, rows, stream);
  if (status != cudaSuccess) return status;
  ReceiveRowsKernel<<<SendGrid(ctx), kThreads, 0, stream>>>(ctx, out_tokens, out_weights,
                                                            recv_row_pos);
  return cudaGetLastError();
}

cudaError_t LaunchReceiveRowsDequantized(const ExchangeContext& ctx, Dtype dtype, int64_t hidden,
                                         char* out_tokens, float* out_weights,
                                         int32_t* recv_row_pos, int64_t rows, cudaStream_t stream) {
  if (ctx.row_bytes != Fp8WireBytes(hidden)) return cudaErrorInvalidValue;
  cudaError_t status = PrefillReceive(ctx, out_tokens, hidden * DtypeBytes(dtype), out_weights,
                                      recv_row_pos, rows, stream);
  if (status != cudaSuccess) return status;
  return ByDtype(dtype, [&](auto d) {
    ReceiveRowsDequantizedKernel<decltype(d)::value><<<SendGrid(ctx), kThreads, 0, stream>>>(
        ctx, hidden, out_tokens, out_weights, recv_row_pos);
  });
}

cudaError_t LaunchPrefillRedispatch(int64_t rows, int64_t row_bytes, Dtype dtype,
                                    const float* scale, char* out_tokens, char* out_scaled,
                                    cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(rows, 4096)));
  return ByDtype(dtype, [&](auto d) {
    PrefillRedispatchKernel<decltype(d)::value>
        <<<grid, 256, 0, stream>>>(rows, row_bytes, scale, out_tokens, out_scaled);
  });
}

cudaError_t LaunchReceiveRedispatch(const ExchangeContext& ctx, Dtype dtype,
                                    const int32_t* recv_row_pos, const float* scale,
                                    char* out_tokens, char* out_scaled, cudaStream_t stream) {
  if (cudaError_t s = CheckContext(ctx); s != cudaSuccess) return s;
  return ByDtype(dtype, [&](auto d) {
    ReceiveRedispatchKernel<decltype(d)::value>
        <<<SendGrid(ctx), kThreads, 0, stream>>>(ctx, recv_row_pos, scale, out_tokens, out_scaled);
  });
}

cudaError_t LaunchSendPartials(const ExchangeContext& ctx, Dtype dtype, const char* y,
                               const float* weights, const int32_t* recv_row_pos,
                               cudaStream_t stream) {
  if (cudaError_t s = CheckContext(ctx); s != cudaSuccess) return s;
  return ByDtype(dtype, [&](auto d) {
    SendPartialsKernel<decltype(d)::value>
        <<<SendGrid(ctx), kThreads, 0, stream>>>(ctx, y, weights, recv_row_pos);
  });
}

cudaError_t LaunchReducePartials(const ExchangeContext& ctx, Dtype dtype, const int32_t* dest,
                                 char* out, cudaStream_t stream) {
  if (cudaError_t s = CheckContext(ctx); s != cudaSuccess) return s;
  return ByDtype(dtype, [&](auto d) {
    ReducePartialsKernel<decltype(d)::value>
        <<<SendGrid(ctx), kThreads, 0, stream>>>(ctx, dest, out);
  });
}

cudaError_t LaunchSendRowValues(const ExchangeContext& ctx, const float* values,
                                const int32_t* recv_row_pos, cudaStream_t stream) {
  if (cudaError_t s = CheckContext(ctx); s != cudaSuccess) return s;
  SendRowValuesKernel<<<SendGrid(ctx), kThreads, 0, stream>>>(ctx, values, recv_row_pos);
  return cudaGetLastError();
}

cudaError_t LaunchReceiveRowValues(const ExchangeContext& ctx, const int32_t* dest, float* out,
                                   cudaStream_t stream) {
  if (cudaError_t s = CheckContext(ctx); s != cudaSuccess) return s;
  ReceiveRowValuesKernel<<<SendGrid(ctx), kThreads, 0, stream>>>(ctx, dest, out);
  return cudaGetLastError();
}

}  // namespace jax_hybridep
