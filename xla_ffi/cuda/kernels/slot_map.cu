// The slot map's kernels (slot_map.h): per chunk of kSendChunk items, the items each
// destination receives (count), their running totals over (source, chunk) in order (scan), then
// every (item, destination)'s slot and the receiver's row map (assign). Integer steps only: the
// same bits as the reference SlotMapReference (lab/native/cuda/reference.cc).
#include <cuda_runtime.h>

#include <cstdint>

#include "xla_ffi/common/limits.h"  // kMaxWindowRanks
#include "xla_ffi/cuda/device/launch.h"
#include "xla_ffi/cuda/device/ptx.cuh"
#include "xla_ffi/cuda/kernels/slot_map.h"

namespace jax_hybridep {
namespace {

constexpr int kMaskWords = kMaxWindowRanks / 32;
constexpr int kScanThreads = 256;
static_assert(kSendChunk == 64, "the count and assign kernels run a chunk as two warps");

struct DestMask {
  uint32_t bits[kMaskWords];
};

// The destinations of item m of source s as bits (none for m >= M or out-of-range entries).
__device__ DestMask ItemDestinations(const SlotMapShape& shape, const int32_t* gathered, int64_t s,
                                     int64_t m) {
  DestMask mask = {};
  if (m >= shape.items) return mask;
  const int32_t* e = gathered + (s * shape.items + m) * shape.k * 3;
  for (int64_t k = 0; k < shape.k; ++k) {
    const int32_t d = e[3 * k];
    if (d < 0 || d >= shape.ranks) continue;
#pragma unroll
    for (int w = 0; w < kMaskWords; ++w) {
      if (d / 32 == w) mask.bits[w] |= 1u << (d % 32);
    }
  }
  return mask;
}

__device__ bool Has(const DestMask& mask, int p) {
  bool has = false;
#pragma unroll
  for (int w = 0; w < kMaskWords; ++w)
    has = has || (p / 32 == w && ((mask.bits[w] >> (p % 32)) & 1u));
  return has;
}

// The exclusive prefix sum of `value` over the block's kScanThreads threads (`before`) and their
// total: each warp scans by shuffles, then every thread adds the totals of the warps before its
// own. warp_totals: kScanThreads / 32 shared ints, free again after the caller's next barrier.
__device__ void BlockExclusiveSum(int32_t value, int32_t* warp_totals, int32_t& before,
                                  int32_t& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int32_t warps_before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kScanThreads / 32; ++w) {
    warps_before += w < warp ? warp_totals[w] : 0;
    total += warp_totals[w];
  }
  before = warps_before + inclusive - value;
}

int64_t Chunks(const SlotMapShape& shape) { return ChunkPadded(shape.items) / kSendChunk; }

// count[(s * chunks + c) * S + p]: items of chunk c of source s going to p. Grid (chunks, S).
__global__ void __launch_bounds__(kSendChunk)
    CountChunksKernel(SlotMapShape shape, const int32_t* gathered, int32_t* count) {
  const int64_t c = blockIdx.x, s = blockIdx.y, chunks = gridDim.x;
  const DestMask mask = ItemDestinations(shape, gathered, s, c * kSendChunk + threadIdx.x);
  JAX_HYBRIDEP_SHARED_ARRAY(int32_t, first_warp, kMaxWindowRanks, 4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int p = 0; p < shape.ranks; ++p) {
    const int n = __popc(__ballot_sync(0xffffffffu, Has(mask, p)));
    if (warp == 0 && lane == 0) first_warp[p] = n;
    __syncthreads();
    if (warp == 1 && lane == 0) count[(s * chunks + c) * shape.ranks + p] = first_warp[p] + n;
  }
}

// base[(s * chunks + c) * S + p]: items of (source, chunk) pairs before (s, c) going to p, and
// info[0] = the total at p = rank. Grid S (one block per destination p).
__global__ void __launch_bounds__(kScanThreads)
    ScanChunksKernel(SlotMapShape shape, int64_t chunks, const int32_t* rank, const int32_t* count,
                     int32_t* base, int32_t* info) {
  JAX_HYBRIDEP_SHARED_ARRAY(int32_t, warp_totals, kScanThreads / 32, 4);
  JAX_HYBRIDEP_SHARED_VAR(int32_t, carry, 4);
  const int64_t p = blockIdx.x, S = shape.ranks, n = S * chunks;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t begin = 0; begin < n; begin += kScanThreads) {
    const int64_t i = begin + threadIdx.x;
    const int32_t value = i < n ? count[i * S + p] : 0;
    int32_t before = 0, total = 0;
    BlockExclusiveSum(value, warp_totals, before, total);
    if (i < n) base[i * S + p] = carry + before;
    __syncthreads();  // everyone read `carry` and the warps' totals
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0 && p == *rank) info[0] = carry;
}

// Every (item, destination)'s slot (send side when s is this rank) and the receiver's map (when
// the destination is this rank). Grid (chunks, S).
__global__ void __launch_bounds__(kSendChunk)
    AssignSlotsKernel(SlotMapShape shape, const int32_t* rank_ptr, const int32_t* gathered,
                      const int32_t* base, int32_t* send_slot, int32_t* recv_item,
                      int32_t* recv_rows, float* row_weights, int32_t* row_slot, int32_t* info) {
  const int64_t c = blockIdx.x, s = blockIdx.y, chunks = gridDim.x;
  const int64_t S = shape.ranks, M = shape.items, K = shape.k;
  const int32_t rank = *rank_ptr;
  const int64_t m = c * kSendChunk + threadIdx.x;
  const DestMask mask = ItemDestinations(shape, gathered, s, m);
  JAX_HYBRIDEP_SHARED_ARRAY(uint32_t, first_warp, kMaxWindowRanks, 4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t below = (1u << lane) - 1u;
  for (int p = 0; p < S; ++p) {
    const bool has = Has(mask, p);
    const uint32_t ballot = __ballot_sync(0xffffffffu, has);
    if (warp == 0 && lane == 0) first_warp[p] = ballot;
    __syncthreads();
    if (!has) continue;
    const int32_t before = __popc(ballot & below) + (warp == 1 ? __popc(first_warp[p]) : 0);
    const int32_t j = base[(s * chunks + c) * S + p] + before;
    if (s == rank) send_slot[m * S + p] = j;
    if (p != rank) continue;
    recv_item[j] = static_cast<int32_t>(s * M + m);
    const int32_t* e = gathered + (s * M + m) * K * 3;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t row = e[3 * k + 1];
      if (e[3 * k] != rank || row < 0 || row >= shape.rows) continue;
      recv_rows[j * K + k] = row;
      row_weights[row] = __int_as_float(e[3 * k + 2]);
      row_slot[row] = j;
      atomicMax(&info[1], row + 1);
    }
  }
}

}  // namespace

size_t SlotMapWorkspaceBytes(const SlotMapShape& shape) {
  // count and base, [S, chunks, S] int32 each.
  return 2 * static_cast<size_t>(shape.ranks * Chunks(shape) * shape.ranks) * sizeof(int32_t);
}

cudaError_t LaunchSlotMap(const SlotMapShape& shape, const int32_t* rank, const int32_t* gathered,
                          int32_t* send_slot, int32_t* recv_item, int32_t* recv_rows,
                          float* row_weights, int32_t* row_slot, int32_t* info, void* workspace,
                          cudaStream_t stream) {
  if (shape.ranks < 1 || shape.ranks > kMaxWindowRanks || shape.items < 0 || shape.k < 1) {
    return cudaErrorInvalidValue;
  }
  const int64_t S = shape.ranks, M = shape.items, chunks = Chunks(shape);
  const size_t slots = static_cast<size_t>(ChunkPadded(S * M));
  cudaError_t s = cudaMemsetAsync(send_slot, 0xff, ChunkPadded(M) * S * sizeof(int32_t), stream);
  if (s == cudaSuccess) s = cudaMemsetAsync(recv_item, 0xff, slots * sizeof(int32_t), stream);
  if (s == cudaSuccess) {
    s = cudaMemsetAsync(recv_rows, 0xff, slots * shape.k * sizeof(int32_t), stream);
  }
  if (s == cudaSuccess) s = cudaMemsetAsync(row_weights, 0, shape.rows * sizeof(float), stream);
  if (s == cudaSuccess) s = cudaMemsetAsync(row_slot, 0xff, shape.rows * sizeof(int32_t), stream);
  if (s == cudaSuccess) s = cudaMemsetAsync(info, 0, 2 * sizeof(int32_t), stream);
  if (s != cudaSuccess || M == 0) return s;
  int32_t* count = static_cast<int32_t*>(workspace);
  int32_t* base = count + S * chunks * S;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(S));
  s = LaunchKernel(&CountChunksKernel, grid, dim3(kSendChunk), 0, stream, shape, gathered, count);
  if (s != cudaSuccess) return s;
  s = LaunchKernel(&ScanChunksKernel, dim3(static_cast<unsigned>(S)), dim3(kScanThreads), 0, stream,
                   shape, chunks, rank, count, base, info);
  if (s != cudaSuccess) return s;
  return LaunchKernel(&AssignSlotsKernel, grid, dim3(kSendChunk), 0, stream, shape, rank, gathered,
                      base, send_slot, recv_item, recv_rows, row_weights, row_slot, info);
}

}  // namespace jax_hybridep
