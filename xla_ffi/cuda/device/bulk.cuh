// The bulk-copy engine and the mbarriers its copies complete on, as the send kernel uses them
// (Hopper's cp.async.bulk, one elected lane issuing), over the PTX layer (ptx.cuh). Included by
// the .cu files only.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_BULK_CUH_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_BULK_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "xla_ffi/cuda/device/ptx.cuh"

namespace jax_hybridep {
namespace device {

__device__ __forceinline__ void BarrierInit(uint64_t* bar, uint32_t count) {
  ptx::MbarrierInit(bar, count);
}
__device__ __forceinline__ void BarrierArrive(uint64_t* bar) { ptx::MbarrierArrive(bar); }
__device__ __forceinline__ void BarrierExpectBytes(uint64_t* bar, uint32_t bytes) {
  ptx::MbarrierArriveExpectTx(bar, bytes);
}

// Waits for the completion of the barrier's phase of parity `parity`.
__device__ __forceinline__ void BarrierWait(uint64_t* bar, uint32_t parity) {
  while (!ptx::MbarrierTryWaitParity(bar, parity)) {
  }
}

// global -> shared, completing `bytes` on the barrier (16-byte aligned, a multiple of 16).
__device__ __forceinline__ void BulkLoad(void* smem, const void* global, uint32_t bytes,
                                         uint64_t* bar) {
  ptx::BulkLoadGlobalToShared(smem, global, bytes, bar);
}

// shared -> global (16-byte aligned, a multiple of 16), in the thread's current bulk group.
__device__ __forceinline__ void BulkStore(void* global, const void* smem, uint32_t bytes) {
  ptx::BulkStoreSharedToGlobal(global, smem, bytes);
}

__device__ __forceinline__ void BulkCommit() { ptx::BulkCommitGroup(); }

// Every bulk group of this thread but the newest `kPending` has finished reading shared memory.
template <int kPending>
__device__ __forceinline__ void BulkWaitRead() {
  ptx::BulkWaitGroupRead<kPending>();
}

// Every bulk group of this thread is complete (its writes performed), and visible to the
// generic proxy (the flag that follows).
__device__ __forceinline__ void BulkWaitAll() {
  ptx::BulkWaitGroup<0>();
  ptx::FenceProxyAsyncGlobal();
}

// Shared memory written by ordinary stores, read next by the bulk-copy engine.
__device__ __forceinline__ void FenceSharedForBulk() { ptx::FenceProxyAsyncShared(); }

}  // namespace device
}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_BULK_CUH_
