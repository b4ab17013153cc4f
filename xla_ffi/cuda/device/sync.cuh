// How the transport's kernels (kernels/transport.h) synchronise across GPUs: the window's regions,
// flag tags, waits that time out or detect a mismatch, and the end of an exchange; over the PTX
// layer (ptx.cuh). Included by the .cu files only.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_SYNC_CUH_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_SYNC_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "xla_ffi/cuda/device/ptx.cuh"
#include "xla_ffi/cuda/kernels/transport.h"

namespace jax_hybridep {
namespace device {

// A spinning wait checks whether another wait already failed this often (a read of mapped memory).
constexpr int kPollsPerErrorCheck = 1024;

// ---------------------------------------------------------------------------- window regions

__device__ __forceinline__ char* Payload(char* base, const ExchangeParams& ex,
                                         uint64_t generation) {
  return base + ex.window.payload[generation & 1];
}
__device__ __forceinline__ uint64_t* Arrived(char* base, const ExchangeParams& ex) {
  return reinterpret_cast<uint64_t*>(base + ex.window.arrived);
}
__device__ __forceinline__ uint64_t* Epoch(char* base, const ExchangeParams& ex) {
  return reinterpret_cast<uint64_t*>(base + ex.window.epoch);
}

// This exchange's number: one more than the exchanges this rank finished on the window (read by
// every kernel of the exchange; the final kernel's last block advances it).
__device__ __forceinline__ uint64_t Generation(char* own, const ExchangeParams& ex) {
  return *reinterpret_cast<volatile uint64_t*>(Epoch(own, ex)) + 1;
}

// A flag's tag: the exchange number above the call site's low 32 bits.
__device__ __forceinline__ uint64_t Tag(uint64_t generation, uint32_t site) {
  return (generation << 32) | site;
}

// ---------------------------------------------------------------------------- flags

__device__ __forceinline__ uint64_t GlobalTimerNs() { return ptx::GlobalTimerNs(); }
__device__ __forceinline__ uint64_t LoadAcquire(const uint64_t* flag) {
  return ptx::LoadAcquireSys(flag);
}
__device__ __forceinline__ void StoreRelease(uint64_t* flag, uint64_t v) {
  ptx::StoreReleaseSys(flag, v);
}

// Records this rank's first failed wait in the mapped record (system-scope stores, the only
// narrow ones the wide kernels may hold: tests/cuda_sass_test.py).
__device__ inline void RecordFailure(TransportError* error, uint32_t* claim, uint32_t code,
                                     int32_t rank, int64_t peer, int64_t block, uint64_t generation,
                                     uint64_t seen, uint64_t expected) {
  if (atomicCAS(claim, 0u, 1u) != 0u) return;
  volatile TransportError* e = error;
  e->rank = static_cast<uint32_t>(rank);
  e->peer = static_cast<uint32_t>(peer);
  e->block = static_cast<uint32_t>(block);
  e->generation = generation;
  e->seen = seen;
  e->expected = expected;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

// One thread waits for the flag of source `src`'s send block `block` in this rank's window:
// true once it carries this exchange's tag, or the next exchange's number (that peer is already
// ahead, writing the other half). False on a mismatch or after the timeout, each recorded, or
// when another wait of this rank already failed.
__device__ inline bool WaitFlag(char* own, const ExchangeParams& ex, uint64_t generation,
                                int64_t src, int64_t block) {
  const uint64_t* flag = Arrived(own, ex) + src * kMaxSendBlocks + block;
  uint32_t* claim = reinterpret_cast<uint32_t*>(own + ex.window.error_claim);
  const uint64_t want = Tag(generation, ex.site);
  uint64_t start = 0;
  for (int polls = 0;; ++polls) {
    const uint64_t seen = LoadAcquire(flag);
    // The tag keeps the exchange number's low 32 bits: compare modulo 2^32 (a window may serve
    // more than 2^32 exchanges); behind is "not yet" (int32 < 0).
    const uint32_t ahead = static_cast<uint32_t>(seen >> 32) - static_cast<uint32_t>(generation);
    if (seen == want || ahead == 1u) return true;
    if (ahead == 0u || static_cast<int32_t>(ahead) > 1) {  // another site, or further ahead
      RecordFailure(ex.error, claim, kWaitMismatch, ex.rank, src, block, generation, seen, want);
      return false;
    }
    if (polls == 0) start = GlobalTimerNs();
    if (polls % kPollsPerErrorCheck == kPollsPerErrorCheck - 1) {
      if (*static_cast<volatile uint32_t*>(claim) != 0u) return false;
      if (static_cast<int64_t>(GlobalTimerNs() - start) > ex.timeout_ns) {
        RecordFailure(ex.error, claim, kWaitTimeout, ex.rank, src, block, generation, seen, want);
        return false;
      }
    }
    __nanosleep(64);
  }
}

// Block-wide: every (source, send block) flag of this exchange, polled by the block's threads
// side by side; true when all came.
__device__ inline bool BlockWaitAll(char* own, const ExchangeParams& ex, uint64_t generation) {
  const int flags = ex.ranks * ex.send_blocks;  // <= 128 * 256
  bool ok = true;
  for (int i = threadIdx.x; i < flags && ok; i += blockDim.x) {
    ok = WaitFlag(own, ex, generation, i / ex.send_blocks, i % ex.send_blocks);
  }
  return __syncthreads_and(ok) != 0;
}

// The end of an exchange's final kernel: the last block to finish advances this rank's epoch, so
// the next exchange's kernels (later on the stream) read the next number (atomics: no plain
// stores besides the rows).
__device__ inline void CountBlockDone(uint32_t* done, uint64_t* epoch, uint32_t blocks) {
  __threadfence();
  if (atomicAdd(done, 1u) == blocks - 1) {
    atomicExch(done, 0u);
    atomicAdd(reinterpret_cast<unsigned long long*>(epoch), 1ull);
    __threadfence();
  }
}

__device__ inline void FinishExchange(char* own, const ExchangeParams& ex) {
  __syncthreads();
  if (threadIdx.x == 0) {
    CountBlockDone(reinterpret_cast<uint32_t*>(own + ex.window.done), Epoch(own, ex), gridDim.x);
  }
}

// Raises this block's flag in every peer's window once its stores are complete and visible.
__device__ inline void SignalPeers(const PeerWindows& peers, const ExchangeParams& ex,
                                   uint64_t tag) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  for (int p = 0; p < ex.ranks; ++p) {
    StoreRelease(Arrived(peers.base[p], ex) + ex.rank * kMaxSendBlocks + blockIdx.x, tag);
  }
}

}  // namespace device
}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_SYNC_CUH_
