// The per-SM copy ceilings the transport is built against (docs/gpu.md "What a lease measures"):
// a copy of `bytes` through `blocks` blocks, either by 16-byte LSU loads and stores or by the
// bulk-copy engine (global -> shared -> global, the transport's path), so one lease measures C_sm
// of both at 1 and 8 SMs.
#include <cuda_runtime.h>

#include <cstdint>

#include "lab/native/cuda/copy_ceiling.h"
#include "xla_ffi/cuda/device/bulk.cuh"

namespace jax_hybridep {
namespace {
using namespace device;  // NOLINT: the kernels' device helpers

constexpr int kLsuThreads = 256;
constexpr int kLsuInFlight = 8;
constexpr int kBulkStages = 12;
constexpr int64_t kBulkChunk = 16384;

// Every thread keeps kLsuInFlight 16-byte loads in flight before it stores them.
__global__ void __launch_bounds__(kLsuThreads)
    LsuCopyKernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t words) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kLsuThreads * kLsuInFlight;
  for (int64_t base = (static_cast<int64_t>(blockIdx.x) * kLsuThreads * kLsuInFlight) + threadIdx.x;
       base < words; base += step) {
    uint4 v[kLsuInFlight];
#pragma unroll
    for (int i = 0; i < kLsuInFlight; ++i) {
      if (base + i * kLsuThreads < words) v[i] = src[base + i * kLsuThreads];
    }
#pragma unroll
    for (int i = 0; i < kLsuInFlight; ++i) {
      if (base + i * kLsuThreads < words) dst[base + i * kLsuThreads] = v[i];
    }
  }
}

// One elected thread per block streams its chunks through kBulkStages shared stages: the loads
// run kBulkStages ahead; a stage is reloaded once its store has read it.
__global__ void __launch_bounds__(32, 1) BulkCopyKernel(const char* src, char* dst, int64_t bytes) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t full[kBulkStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kBulkStages; ++s) BarrierInit(&full[s], 1);
  ptx::FenceMbarrierInit();
  const int64_t chunks = (bytes + kBulkChunk - 1) / kBulkChunk;
  auto load = [&](int64_t n, int64_t chunk) {
    const int s = n % kBulkStages;
    const int64_t offset = chunk * kBulkChunk;
    const uint32_t size =
        static_cast<uint32_t>(bytes - offset < kBulkChunk ? bytes - offset : kBulkChunk);
    BarrierExpectBytes(&full[s], size);
    BulkLoad(ring + s * kBulkChunk, src + offset, size, &full[s]);
  };
  int64_t n = 0;
  for (int64_t chunk = blockIdx.x; chunk < chunks && n < kBulkStages; chunk += gridDim.x, ++n) {
    load(n, chunk);
  }
  // As the send kernel does, a stage is released one store late (wait_group.read 1): this
  // store is issued before waiting for the previous one to have read its stage.
  n = 0;
  const int64_t ahead = static_cast<int64_t>(gridDim.x) * kBulkStages;
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x, ++n) {
    const int s = n % kBulkStages;
    BarrierWait(&full[s], (n / kBulkStages) & 1);
    const int64_t offset = chunk * kBulkChunk;
    const uint32_t size =
        static_cast<uint32_t>(bytes - offset < kBulkChunk ? bytes - offset : kBulkChunk);
    BulkStore(dst + offset, ring + s * kBulkChunk, size);
    BulkCommit();
    const int64_t previous = chunk - gridDim.x;  // the previous store's chunk (n - 1)
    if (n > 0 && previous + ahead < chunks) {
      BulkWaitRead<1>();
      load(n - 1 + kBulkStages, previous + ahead);
    }
  }
  // The last chunk's stage needs no reload: its next chunk is past the end (chunk + gridDim.x
  // already is).
  BulkWaitAll();
}

}  // namespace

cudaError_t LaunchCopyCeiling(CopyPath path, const char* src, char* dst, int64_t bytes, int blocks,
                              cudaStream_t stream) {
  if (blocks < 1 || bytes % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(dst) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  if (path == CopyPath::kLsu) {
    LsuCopyKernel<<<blocks, kLsuThreads, 0, stream>>>(reinterpret_cast<const uint4*>(src),
                                                      reinterpret_cast<uint4*>(dst), bytes / 16);
    return cudaGetLastError();
  }
  const int smem = static_cast<int>(kBulkStages * kBulkChunk);
  cudaError_t s =
      cudaFuncSetAttribute(&BulkCopyKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (s != cudaSuccess) return s;
  BulkCopyKernel<<<blocks, 32, smem, stream>>>(src, dst, bytes);
  return cudaGetLastError();
}

}  // namespace jax_hybridep
