// The transport's flags and waits (transport.h, "Protocol"): a sender block raises its flag in
// every peer's window with a system-scope release once its rows are visible; a receiver waits for
// a flag with an acquire, giving up after the context's timeout and recording the first failure in
// the mapped host error record (never a hang).
// Device code is compiled into every .cu file that includes it (whole-program CUDA, no device
// linking), so it has internal linkage here.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_TRANSPORT_SYNC_CUH_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_TRANSPORT_SYNC_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "xla_ffi/cuda/transport.h"

namespace jax_hybridep {
namespace {

// A spinning wait checks whether another wait already failed this often (a mapped-host read).
constexpr int kPollsPerErrorCheck = 1024;

__device__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ uint64_t LoadAcquire(const uint64_t* flag) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
  return v;
}

__device__ void StoreRelease(uint64_t* flag, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" : : "l"(flag), "l"(v) : "memory");
}

// Records the first failed wait of this rank (claimed in device memory, written to mapped host
// memory) so the host can report it.
__device__ void RecordTimeout(const ExchangeContext& ctx, int64_t peer, int64_t block) {
  if (atomicCAS(ctx.windows[ctx.rank].error_claim, 0u, 1u) != 0u) return;
  volatile TransportError* e = ctx.error;
  e->rank = static_cast<uint32_t>(ctx.rank);
  e->peer = static_cast<uint32_t>(peer);
  e->block = static_cast<uint32_t>(block);
  e->generation = ctx.generation;
  __threadfence_system();
  e->code = 1;
  __threadfence_system();
}

// One thread waits until source `src`'s block `block` completed this generation here; false when
// the timeout passed (or another wait of this rank already failed).
__device__ bool WaitArrived(const ExchangeContext& ctx, int64_t src, int64_t block) {
  const uint64_t* flag = ctx.windows[ctx.rank].arrived + src * kMaxSendBlocks + block;
  if (LoadAcquire(flag) >= ctx.generation) return true;
  const uint64_t start = GlobalTimerNs();
  for (int polls = 1;; ++polls) {
    if (LoadAcquire(flag) >= ctx.generation) return true;
    if (polls % kPollsPerErrorCheck == 0) {
      if (*static_cast<volatile uint32_t*>(ctx.windows[ctx.rank].error_claim) != 0u) return false;
      if (static_cast<int64_t>(GlobalTimerNs() - start) > ctx.timeout_ns) {
        RecordTimeout(ctx, src, block);
        return false;
      }
    }
    __nanosleep(32);
  }
}

// Block-wide WaitArrived (thread 0 waits, every thread gets the answer).
__device__ bool BlockWaitArrived(const ExchangeContext& ctx, int64_t src, int64_t block) {
  __shared__ int ok;
  __syncthreads();  // `ok` may still be read from the previous call.
  if (threadIdx.x == 0) ok = WaitArrived(ctx, src, block);
  __syncthreads();
  return ok != 0;
}

// Ends a send phase: once every thread of the block is done, its rows are made visible system-wide
// and the block's flag is raised in every peer's window.
__device__ void SignalBlockDone(const ExchangeContext& ctx, int64_t block) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int64_t d = 0; d < ctx.ranks; ++d) {
      StoreRelease(ctx.windows[d].arrived + ctx.rank * kMaxSendBlocks + block, ctx.generation);
    }
  }
}

}  // namespace
}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_TRANSPORT_SYNC_CUH_
