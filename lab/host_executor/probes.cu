// Probe kernels of the host executor's own tests (tests/host_executor_test.py): each primitive
// the transport's kernels use, driven through the same device layer (ptx.cuh), with results the
// tests hold against the PTX ISA's and the CUDA programming guide's semantics; and misused
// primitives the executor must report. Compiled like the kernels (instrumented, the C++ compiler).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "lab/host_executor/probe_support.h"
#include "lab/host_executor/probes.h"
#include "xla_ffi/cuda/device/launch.h"
#include "xla_ffi/cuda/device/ptx.cuh"

namespace jax_hybridep::host {
namespace {

constexpr unsigned kAll = 0xffffffffu;

// ---------------------------------------------------------------------------- kernels

// Per thread, 8 results: shuffles by index, xor, up, down, by index in segments of 8, a ballot,
// a half-warp ballot (-1 outside it) and the block's __syncthreads_count.
__global__ void WarpCollectives(int* out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int v = 100 * warp + lane;
  int* o = out + threadIdx.x * 8;
  o[0] = __shfl_sync(kAll, v, (lane + 3) % 32);
  o[1] = __shfl_xor_sync(kAll, v, 5);
  o[2] = __shfl_up_sync(kAll, v, 2u);
  o[3] = __shfl_down_sync(kAll, v, 3u);
  o[4] = __shfl_sync(kAll, v, 1, 8);
  o[5] = static_cast<int>(__ballot_sync(kAll, lane % 3 == 0));
  o[6] = lane < 16 ? static_cast<int>(__ballot_sync(0x0000ffffu, lane % 2)) : -1;
  o[7] = __syncthreads_count(lane % 4 == 0);
}

// Per thread: __match_any_sync of lane % 5 over the warp, and of lane / 4 over the low half-warp
// (-1 outside it).
__global__ void MatchAny(int* out) {
  const int lane = threadIdx.x % 32;
  out[2 * threadIdx.x] = static_cast<int>(__match_any_sync(kAll, lane % 5));
  out[2 * threadIdx.x + 1] =
      lane < 16 ? static_cast<int>(__match_any_sync(0x0000ffffu, lane / 4)) : -1;
}

// Per thread: __syncthreads_and / _or of predicates true everywhere, somewhere, nowhere.
__global__ void BlockReductions(int* out) {
  const int t = threadIdx.x;
  int* o = out + t * 4;
  o[0] = __syncthreads_and(1);
  o[1] = __syncthreads_and(t != 7);
  o[2] = __syncthreads_or(t == 7);
  o[3] = __syncthreads_or(0);
}

// out[0..]: atomicAdd's old values (one per thread), then the final add counter, max, CAS
// counter, 64-bit counter and the exchanged value.
__global__ void Atomics(unsigned* counters, unsigned long long* wide, unsigned* olds) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  olds[t] = atomicAdd(&counters[0], 1u);
  atomicMax(reinterpret_cast<int*>(&counters[1]), static_cast<int>(t));
  for (unsigned seen = *static_cast<volatile unsigned*>(&counters[2]);;) {  // CAS increments
    const unsigned before = atomicCAS(&counters[2], seen, seen + 1);
    if (before == seen) break;
    seen = before;
  }
  atomicAdd(wide, 1ull << 33);
  atomicExch(&counters[3], t + 1000);
}

// Two phases of an mbarrier of the block's threads; out[t] = 2 when both completed for t, and
// out[blockDim + t] = 1 when waiting for the parity-1 phase before anything arrived returned at
// once (the phase before the first counts as completed).
__global__ void MbarrierPhases(int* out) {
  JAX_HYBRIDEP_SHARED_ARRAY(uint64_t, bar, 1, 8);
  if (threadIdx.x == 0) {
    ptx::MbarrierInit(bar, blockDim.x);
    ptx::FenceMbarrierInit();
  }
  __syncthreads();
  out[blockDim.x + threadIdx.x] = ptx::MbarrierTryWaitParity(bar, 1) ? 1 : 0;
  int done = 0;
  for (uint32_t phase = 0; phase < 2; ++phase) {
    ptx::MbarrierArrive(bar);
    while (!ptx::MbarrierTryWaitParity(bar, phase & 1)) {
    }
    ++done;
  }
  out[threadIdx.x] = done;
}

// A bulk load global -> shared completing on an mbarrier, every lane doubling its words, then a
// bulk store shared -> global: out = 2 * in (`words` int32, a multiple of 4). Without `fence`
// the lanes' doubled words are not made visible to the bulk store (no fence.proxy.async).
__global__ void BulkRoundTrip(const int* in, int* out, int words, bool fence) {
  JAX_HYBRIDEP_SHARED_ARRAY(uint64_t, bar, 1, 8);
  JAX_HYBRIDEP_DYNAMIC_SHARED(int, stage, 128);
  const int lane = threadIdx.x;
  if (lane == 0) {
    ptx::MbarrierInit(bar, 1);
    ptx::FenceMbarrierInit();
  }
  __syncwarp();
  const uint32_t bytes = static_cast<uint32_t>(words * 4);
  if (lane == 0) {
    ptx::MbarrierArriveExpectTx(bar, bytes);
    ptx::BulkLoadGlobalToShared(stage, in, bytes, bar);
  }
  while (!ptx::MbarrierTryWaitParity(bar, 0)) {
  }
  for (int i = lane; i < words; i += 32) stage[i] *= 2;
  if (fence) ptx::FenceProxyAsyncShared();
  __syncwarp();
  if (lane == 0) {
    ptx::BulkStoreSharedToGlobal(out, stage, bytes);
    ptx::BulkCommitGroup();
    ptx::BulkWaitGroup<0>();
  }
}

// %globaltimer around a __nanosleep: out = the elapsed virtual nanoseconds.
__global__ void Timer(unsigned long long* out, unsigned ns) {
  const uint64_t t0 = ptx::GlobalTimerNs();
  __nanosleep(ns);
  const uint64_t t1 = ptx::GlobalTimerNs();
  *out = t1 - t0;
}

// Message passing between two GPUs: GPU 0 writes a payload and raises a flag, GPU 1 waits for
// the flag and copies the payload. `release`: st.release / ld.acquire; else volatile (relaxed)
// stores and loads, which order nothing.
__global__ void Flag(int* payload, uint64_t* flag, int* out, int sender, bool release) {
  const int lane = threadIdx.x;
  if (sender) {
    payload[lane] = 7 * lane + 1;
    __syncwarp();
    if (lane == 0) {
      if (release) {
        ptx::StoreReleaseSys(flag, 1);
      } else {
        *static_cast<volatile uint64_t*>(flag) = 1;
      }
    }
    return;
  }
  if (lane == 0) {
    for (;;) {
      const uint64_t seen =
          release ? ptx::LoadAcquireSys(flag) : *static_cast<volatile uint64_t*>(flag);
      if (seen == 1) break;
      __nanosleep(100);
    }
  }
  __syncwarp();
  out[lane] = payload[lane];
}

// ---------------------------------------------------------------------------- misuse

__global__ void DivergentBarrier() {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

__global__ void ShuffleLeavesOutOwnLane(int* out) {
  out[threadIdx.x] = __shfl_sync(~(1u << 5), static_cast<int>(threadIdx.x), 0);
}

__global__ void ShuffleReadsOutsideMask(int* out) {
  if (threadIdx.x < 16)
    out[threadIdx.x] =
        __shfl_sync(0xffffu, static_cast<int>(threadIdx.x), static_cast<int>(threadIdx.x) + 16);
}

__global__ void BallotWithExitedLanes(int* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = static_cast<int>(__ballot_sync(kAll, 1));
}

// A bulk load of `bytes` completing on a barrier that expected `expect` bytes.
__global__ void BulkBytes(const int* in, uint32_t expect, uint32_t bytes, int offset) {
  JAX_HYBRIDEP_SHARED_ARRAY(uint64_t, bar, 1, 8);
  JAX_HYBRIDEP_DYNAMIC_SHARED(char, stage, 128);
  ptx::MbarrierInit(bar, 1);
  ptx::FenceMbarrierInit();
  ptx::MbarrierArriveExpectTx(bar, expect);
  ptx::BulkLoadGlobalToShared(stage + offset, in, bytes, bar);
  while (!ptx::MbarrierTryWaitParity(bar, 0)) {
  }
}

__global__ void ArriveUninitialised() {
  JAX_HYBRIDEP_SHARED_ARRAY(uint64_t, bar, 1, 8);
  ptx::MbarrierArrive(bar);
}

__global__ void SharedOverrun(int* out) {
  JAX_HYBRIDEP_SHARED_ARRAY(int, a, 32, 4);
  a[threadIdx.x] = static_cast<int>(threadIdx.x);  // 33 threads: one past the end
  __syncthreads();
  out[threadIdx.x] = a[0];
}

// Reads a bulk load's destination without waiting for its barrier (`sleep`: after a pause in
// which the copy engine performs it).
__global__ void ReadBeforeWait(const int* in, int* out, bool sleep) {
  JAX_HYBRIDEP_SHARED_ARRAY(uint64_t, bar, 1, 8);
  JAX_HYBRIDEP_DYNAMIC_SHARED(int, stage, 128);
  ptx::MbarrierInit(bar, 1);
  ptx::FenceMbarrierInit();
  ptx::MbarrierArriveExpectTx(bar, 64);
  ptx::BulkLoadGlobalToShared(stage, in, 64, bar);
  if (sleep) __nanosleep(1000);
  out[0] = stage[3];
  while (!ptx::MbarrierTryWaitParity(bar, 0)) {
  }
}

// Two blocks write one word with nothing between them.
__global__ void PlainRace(int* word) {
  if (threadIdx.x == 0) *word = static_cast<int>(blockIdx.x);
}

// Thread 0 waits on an mbarrier of count 2 that only thread 0 arrives on.
__global__ void MbarrierDeadlock() {
  JAX_HYBRIDEP_SHARED_ARRAY(uint64_t, bar, 1, 8);
  if (threadIdx.x == 0) {
    ptx::MbarrierInit(bar, 2);
    ptx::FenceMbarrierInit();
  }
  __syncthreads();
  if (threadIdx.x == 0) ptx::MbarrierArrive(bar);
  while (!ptx::MbarrierTryWaitParity(bar, 0)) {
  }
}

// A poll of a flag nobody raises, given up after `timeout_ns` of %globaltimer: out = 1 when it
// gave up, and the virtual nanoseconds it waited.
__global__ void PollTimeout(const uint64_t* flag, unsigned long long* out, uint64_t timeout_ns) {
  const uint64_t start = ptx::GlobalTimerNs();
  for (;;) {
    if (ptx::LoadAcquireSys(flag) != 0) {
      out[0] = 0;
      break;
    }
    const uint64_t now = ptx::GlobalTimerNs();
    if (now - start > timeout_ns) {
      out[0] = 1;
      out[1] = now - start;
      break;
    }
    __nanosleep(64);
  }
}

// ---------------------------------------------------------------------------- launchers

std::vector<int64_t> Run(const std::string& name, int64_t arg) {
  cudaSetDevice(0);
  const dim3 one(1);
  if (name == "warp_collectives") {
    int* out = Device<int>(64 * 8);
    Check(LaunchKernel(&WarpCollectives, one, dim3(64), 0, nullptr, out), "launch");
    Sync();
    return Fetch(out, 64 * 8);
  }
  if (name == "match_any") {
    int* out = Device<int>(64 * 2);
    Check(LaunchKernel(&MatchAny, one, dim3(64), 0, nullptr, out), "launch");
    Sync();
    return Fetch(out, 64 * 2);
  }
  std::vector<int64_t> memory;
  if (RunMemoryProbe(name, arg, &memory)) return memory;
  if (name == "block_reductions") {
    int* out = Device<int>(96 * 4);
    Check(LaunchKernel(&BlockReductions, one, dim3(96), 0, nullptr, out), "launch");
    Sync();
    return Fetch(out, 96 * 4);
  }
  if (name == "atomics") {
    unsigned* counters = Device<unsigned>(4);
    unsigned long long* wide = Device<unsigned long long>(1);
    unsigned* olds = Device<unsigned>(128);
    Check(LaunchKernel(&Atomics, dim3(2), dim3(64), 0, nullptr, counters, wide, olds), "launch");
    Sync();
    std::vector<int64_t> out = Fetch(olds, 128);
    for (int64_t v : Fetch(counters, 4)) out.push_back(v);
    for (int64_t v : Fetch(wide, 1)) out.push_back(v);
    return out;
  }
  if (name == "mbarrier_phases") {
    int* out = Device<int>(128);
    Check(LaunchKernel(&MbarrierPhases, one, dim3(64), 0, nullptr, out), "launch");
    Sync();
    return Fetch(out, 128);
  }
  if (name == "bulk_round_trip" || name == "bulk_store_without_proxy_fence") {
    const int words = static_cast<int>(arg);
    std::vector<int> values(words);
    for (int i = 0; i < words; ++i) values[i] = 3 * i - 40;
    int* in = Device<int>(words);
    int* out = Device<int>(words);
    cudaMemcpy(in, values.data(), words * 4, cudaMemcpyHostToDevice);
    Check(LaunchKernel(&BulkRoundTrip, one, dim3(32), static_cast<size_t>(words) * 4, nullptr, in,
                       out, words, name == "bulk_round_trip"),
          "launch");
    Sync();
    return Fetch(out, words);
  }
  if (name == "timer") {
    auto* out = Device<unsigned long long>(1);
    Check(LaunchKernel(&Timer, one, dim3(1), 0, nullptr, out, static_cast<unsigned>(arg)),
          "launch");
    Sync();
    return Fetch(out, 1);
  }
  if (name == "flag_release" || name == "flag_relaxed") {
    const bool release = name == "flag_release";
    int* payload = Device<int>(32);
    auto* flag = Device<uint64_t>(1);
    cudaSetDevice(1);
    Check(cudaDeviceEnablePeerAccess(0, 0), "cudaDeviceEnablePeerAccess");
    int* out = Device<int>(32, 0xff);
    cudaStream_t s1 = nullptr;
    cudaStreamCreate(&s1);
    Check(LaunchKernel(&Flag, one, dim3(32), 0, s1, payload, flag, out, 0, release), "launch");
    cudaSetDevice(0);
    Check(LaunchKernel(&Flag, one, dim3(32), 0, nullptr, payload, flag, out, 1, release), "launch");
    Sync();
    return Fetch(out, 32);
  }
  if (name == "divergent_barrier") {
    Check(LaunchKernel(&DivergentBarrier, one, dim3(32), 0, nullptr), "launch");
  } else if (name == "shuffle_leaves_out_own_lane") {
    Check(LaunchKernel(&ShuffleLeavesOutOwnLane, one, dim3(32), 0, nullptr, Device<int>(32)),
          "launch");
  } else if (name == "shuffle_reads_outside_mask") {
    Check(LaunchKernel(&ShuffleReadsOutsideMask, one, dim3(32), 0, nullptr, Device<int>(32)),
          "launch");
  } else if (name == "ballot_with_exited_lanes") {
    Check(LaunchKernel(&BallotWithExitedLanes, one, dim3(32), 0, nullptr, Device<int>(32)),
          "launch");
  } else if (name == "tx_underflow") {
    Check(LaunchKernel(&BulkBytes, one, one, 256, nullptr, Device<int>(64), 16u, 32u, 0), "launch");
  } else if (name == "tx_overflow") {
    Check(LaunchKernel(&BulkBytes, one, one, 256, nullptr, Device<int>(64), 1u << 20, 32u, 0),
          "launch");
  } else if (name == "bulk_size") {
    Check(LaunchKernel(&BulkBytes, one, one, 256, nullptr, Device<int>(64), 24u, 24u, 0), "launch");
  } else if (name == "bulk_alignment") {
    Check(LaunchKernel(&BulkBytes, one, one, 256, nullptr, Device<int>(64), 32u, 32u, 8), "launch");
  } else if (name == "bulk_shared_overrun") {
    Check(LaunchKernel(&BulkBytes, one, one, 64, nullptr, Device<int>(64), 64u, 64u, 16), "launch");
  } else if (name == "arrive_uninitialised") {
    Check(LaunchKernel(&ArriveUninitialised, one, one, 0, nullptr), "launch");
  } else if (name == "shared_overrun") {
    Check(LaunchKernel(&SharedOverrun, one, dim3(33), 0, nullptr, Device<int>(33)), "launch");
  } else if (name == "read_before_wait") {
    Check(LaunchKernel(&ReadBeforeWait, one, one, 64, nullptr, Device<int>(16), Device<int>(1),
                       arg != 0),
          "launch");
  } else if (name == "plain_race") {
    Check(LaunchKernel(&PlainRace, dim3(2), dim3(1), 0, nullptr, Device<int>(1)), "launch");
  } else if (name == "mbarrier_deadlock") {
    Check(LaunchKernel(&MbarrierDeadlock, one, dim3(2), 0, nullptr), "launch");
  } else if (name == "poll_timeout") {
    auto* out = Device<unsigned long long>(2);
    Check(LaunchKernel(&PollTimeout, one, one, 0, nullptr, Device<uint64_t>(1), out,
                       static_cast<uint64_t>(arg)),
          "launch");
    Sync();
    return Fetch(out, 2);
  } else {
    throw std::invalid_argument("no probe named " + name);
  }
  Sync();
  return {};
}

}  // namespace

std::vector<int64_t> RunProbe(const std::string& name, int64_t arg) { return Run(name, arg); }

}  // namespace jax_hybridep::host
