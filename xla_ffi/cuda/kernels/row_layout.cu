// CUDA layout kernels: the device twins of PlanGroups and AssignRows (layout.cc), giving the same
// plan and rows bit for bit (docs/design.md §2.1). The counts they start from come all-gathered by
// XLA.
//
// Everything here is integer arithmetic. Atomics only add integers or take their maximum, which
// does not depend on the order, so every output is deterministic; the one order-sensitive step
// (which row a (t, k) gets inside its expert) comes from per-chunk prefix counts, never from the
// order in which atomics arrive.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "xla_ffi/cuda/device/launch.h"
#include "xla_ffi/cuda/kernels/row_layout.h"

namespace jax_hybridep {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// AssignRows: one warp owns one chunk of kChunk consecutive (t, k) ids and walks it in tiles of 32.
constexpr int64_t kTilesPerChunk = 64;
constexpr int64_t kChunk = kWarp * kTilesPerChunk;
constexpr int kAssignWarpsPerBlock = 4;

constexpr int kPlanThreads = 256;
constexpr int kSmallThreads = 256;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A 1-D grid of `blocks` blocks (launch sizes here stay far below the 2^31 - 1 limit).
dim3 Grid(int64_t blocks) { return dim3(static_cast<unsigned>(blocks)); }

__device__ unsigned long long WarpSum(unsigned long long v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_down_sync(kFullMask, v, offset);
  }
  return v;
}

__device__ bool IsExpert(int32_t e, int64_t num_experts) { return e >= 0 && e < num_experts; }

// One block. Threads split the experts, then the ranks: each rank's slots are filled one after
// another, as the CPU kernels do, because a group's offset depends on all the groups before it.
__global__ void PlanGroupsKernel(const int32_t* all_counts, Placement placement, CapacityPlan plan,
                                 int32_t* keep_limit, int32_t* group_offset, int32_t* group_sizes,
                                 int32_t* tokens_per_expert) {
  const int64_t num_experts = placement.num_experts;
  const int64_t num_slots = placement.num_slots;
  const int64_t num_groups = placement.num_ranks * num_slots;
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int64_t total = 0;
    for (int64_t r = 0; r < placement.num_ranks; ++r) total += all_counts[r * num_experts + e];
    tokens_per_expert[e] = static_cast<int32_t>(total);
  }
  // group_sizes doubles as the slot -> expert table until each rank's scan overwrites it. Where two
  // experts claim one slot the CPU kernels keep the later (higher) one; atomicMax does the same.
  for (int64_t i = threadIdx.x; i < num_groups; i += blockDim.x) group_sizes[i] = -1;
  __syncthreads();
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    atomicMax(&group_sizes[placement.rank[e] * num_slots + placement.slot[e]],
              static_cast<int32_t>(e));
  }
  __syncthreads();
  const int64_t pad = plan.pad_multiple;
  for (int64_t r = threadIdx.x; r < placement.num_ranks; r += blockDim.x) {
    int64_t offset = 0;
    for (int64_t s = 0; s < num_slots; ++s) {
      const int64_t e = group_sizes[r * num_slots + s];
      const int64_t rows = e >= 0 ? tokens_per_expert[e] : 0;
      const int64_t room = (plan.rows - offset) / pad * pad;
      int64_t kept = rows < room ? rows : room;
      if (plan.capacity >= 0 && plan.capacity < kept) kept = plan.capacity;
      const int64_t size = (kept + pad - 1) / pad * pad;
      group_sizes[r * num_slots + s] = static_cast<int32_t>(size);
      if (e >= 0) {
        keep_limit[e] = static_cast<int32_t>(kept);
        group_offset[e] = static_cast<int32_t>(offset);
      }
      offset += size;
    }
  }
}

// The chunk of (t, k) ids this thread's warp owns.
__device__ int64_t WarpChunk() {
  return static_cast<int64_t>(blockIdx.x) * kAssignWarpsPerBlock + threadIdx.x / kWarp;
}

// Within one tile of 32 ids, the lanes holding expert e: `same` is their mask (from
// __match_any_sync); the highest of them is the leader that updates the chunk's count for e.
__device__ bool IsLeader(unsigned same, int lane) { return (same >> lane) == 1u; }

// Pass 1 of AssignRows: chunk_counts[c, e] = ids of expert e in chunk c.
__global__ void CountChunksKernel(const int32_t* topk_idx, int64_t n, int64_t num_experts,
                                  int64_t num_chunks, int32_t* chunk_counts) {
  const int lane = threadIdx.x % kWarp;
  const int64_t chunk = WarpChunk();
  if (chunk >= num_chunks) return;  // Whole warps leave together: chunk is uniform in a warp.
  int32_t* counts = chunk_counts + chunk * num_experts;
  for (int64_t tile = 0; tile < kTilesPerChunk; ++tile) {
    const int64_t i = chunk * kChunk + tile * kWarp + lane;
    const int32_t e = i < n ? topk_idx[i] : -1;
    const bool valid = IsExpert(e, num_experts);
    const unsigned same = __match_any_sync(kFullMask, valid ? e : -1);
    if (valid && IsLeader(same, lane)) atomicAdd(&counts[e], __popc(same));
  }
}

// Pass 2: turns chunk_counts into exclusive prefixes over chunks, starting from the rows that lower
// source ranks put in each expert. One thread per expert; chunks in order.
__global__ void ScanChunksKernel(const int32_t* all_counts, int64_t rank, int64_t num_experts,
                                 int64_t num_chunks, int32_t* chunk_counts) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= num_experts) return;
  int64_t running = 0;
  for (int64_t r = 0; r < rank; ++r) running += all_counts[r * num_experts + e];
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t here = chunk_counts[c * num_experts + e];
    chunk_counts[c * num_experts + e] = static_cast<int32_t>(running);
    running += here;
  }
}

// Pass 3: each warp walks its chunk tile by tile, in (t, k) order. A lane's index within its expert
// is the chunk's running count plus the lanes of the same expert below it; the leader then advances
// the running count. Only this warp touches its chunk's row, and __syncwarp orders the leader's
// write before the next tile's reads.
__global__ void AssignChunksKernel(const int32_t* topk_idx, int64_t n, int64_t num_experts,
                                   int64_t num_chunks, const int32_t* keep_limit,
                                   const int32_t* group_offset, int32_t* chunk_counts,
                                   int32_t* row_pos, unsigned long long* dropped) {
  const int lane = threadIdx.x % kWarp;
  const int64_t chunk = WarpChunk();
  if (chunk >= num_chunks) return;
  int32_t* next_index = chunk_counts + chunk * num_experts;
  const unsigned lanes_below = (1u << lane) - 1u;
  unsigned long long local_dropped = 0;
  for (int64_t tile = 0; tile < kTilesPerChunk; ++tile) {
    const int64_t i = chunk * kChunk + tile * kWarp + lane;
    const int32_t e = i < n ? topk_idx[i] : -1;
    const bool valid = IsExpert(e, num_experts);
    const unsigned same = __match_any_sync(kFullMask, valid ? e : -1);
    int64_t base = 0;
    if (valid) {
      base = next_index[e];
      const int64_t index = base + __popc(same & lanes_below);
      if (index < keep_limit[e]) {
        row_pos[i] = static_cast<int32_t>(group_offset[e] + index);
      } else {
        row_pos[i] = -1;
        ++local_dropped;
      }
    } else if (i < n) {
      row_pos[i] = -1;
    }
    __syncwarp();
    if (valid && IsLeader(same, lane)) next_index[e] = static_cast<int32_t>(base + __popc(same));
    __syncwarp();
  }
  local_dropped = WarpSum(local_dropped);
  if (lane == 0 && local_dropped != 0) atomicAdd(dropped, local_dropped);
}

}  // namespace

cudaError_t LaunchPlanGroups(const int32_t* all_counts, const Placement& placement,
                             const CapacityPlan& plan, int32_t* keep_limit, int32_t* group_offset,
                             int32_t* group_sizes, int32_t* tokens_per_expert,
                             cudaStream_t stream) {
  return LaunchKernel(&PlanGroupsKernel, dim3(1), dim3(kPlanThreads), 0, stream, all_counts,
                      placement, plan, keep_limit, group_offset, group_sizes, tokens_per_expert);
}

size_t AssignRowsWorkspaceBytes(int64_t tokens, int64_t k, int64_t num_experts) {
  const int64_t num_chunks = std::max<int64_t>(1, CeilDiv(tokens * k, kChunk));
  return static_cast<size_t>(num_chunks * num_experts) * sizeof(int32_t);
}

cudaError_t LaunchAssignRows(const int32_t* topk_idx, int64_t tokens, int64_t k, int64_t rank,
                             const int32_t* all_counts, const Placement& placement,
                             const int32_t* keep_limit, const int32_t* group_offset,
                             int32_t* row_pos, int64_t* dropped, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream) {
  const int64_t n = tokens * k;
  const int64_t num_experts = placement.num_experts;
  if (workspace_bytes < AssignRowsWorkspaceBytes(tokens, k, num_experts)) {
    return cudaErrorInvalidValue;
  }
  cudaError_t status = cudaMemsetAsync(dropped, 0, sizeof(int64_t), stream);
  if (status != cudaSuccess || n == 0 || num_experts == 0) return status;
  const int64_t num_chunks = CeilDiv(n, kChunk);
  int32_t* chunk_counts = static_cast<int32_t*>(workspace);
  status = cudaMemsetAsync(chunk_counts, 0, num_chunks * num_experts * sizeof(int32_t), stream);
  if (status != cudaSuccess) return status;
  const int64_t chunk_blocks = CeilDiv(num_chunks, kAssignWarpsPerBlock);
  const dim3 warps(kAssignWarpsPerBlock * kWarp);
  status = LaunchKernel(&CountChunksKernel, Grid(chunk_blocks), warps, 0, stream, topk_idx, n,
                        num_experts, num_chunks, chunk_counts);
  if (status != cudaSuccess) return status;
  status = LaunchKernel(&ScanChunksKernel, Grid(CeilDiv(num_experts, kSmallThreads)),
                        dim3(kSmallThreads), 0, stream, all_counts, rank, num_experts, num_chunks,
                        chunk_counts);
  if (status != cudaSuccess) return status;
  return LaunchKernel(&AssignChunksKernel, Grid(chunk_blocks), warps, 0, stream, topk_idx, n,
                      num_experts, num_chunks, keep_limit, group_offset, chunk_counts, row_pos,
                      reinterpret_cast<unsigned long long*>(dropped));
}

}  // namespace jax_hybridep
