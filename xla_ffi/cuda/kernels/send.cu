// The transport's send kernels (transport.h): persistent blocks of one G2S warp and kS2GWarps
// S2G warps moving whole rows through a ring of shared-memory stages with the bulk-copy engine.
//
// Per chunk of kSendChunk items the G2S warp's elected lane bulk-loads the chunk's row map into one
// of two shared slots (the next chunk's is prefetched while this one's rows move), then each
// item's row (when it goes anywhere) into the next free stage. The S2G warps take the staged rows
// in turn; for each, one elected lane issues one cp.async.bulk global <- shared per destination
// GPU into that peer's window, commits them as one group and hands the stage back once the group
// has read it (one group kept in flight). With FP8 on the wire the S2G warp first quantises the
// staged token into its wire row in place (fp8.h's steps, a block's amax over the warp's lanes).
// Rows that are not 16-byte aligned in memory, or not whole 16-byte words, are loaded by the G2S
// warp's lanes instead; stores stay bulk (a slot's padding absorbs the rounding up).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "xla_ffi/common/fp8.h"
#include "xla_ffi/cuda/device/bulk.cuh"
#include "xla_ffi/cuda/device/launch.h"
#include "xla_ffi/cuda/device/sync.cuh"
#include "xla_ffi/cuda/device/warp.cuh"
#include "xla_ffi/cuda/kernels/transport.h"

namespace jax_hybridep {

namespace {
using namespace device;  // NOLINT: the kernels' device helpers

// What a send kernel moves: rows of `src` to the destinations its row map names.
struct SendArgs {
  ExchangeParams ex;
  const char* src;          // the rows, src_row_bytes apart
  int64_t src_row_bytes;    // bytes of a row as staged
  const int32_t* map;       // the row maps, kSendChunk * map_words int32 per chunk
  int64_t map_words;        // entries per item
  const int32_t* received;  // combine: info (items = info[0]); dispatch: null (items = ex.items)
  bool bulk_load;           // rows 16-byte aligned, whole 16-byte words: G2S by bulk copies
  int64_t hidden;           // FP8: the token's elements (rows quantised on the way); else 0
  SendPlan plan;
};

// The destination map of one item, read from the chunk's shared map slot. Dispatch: entry p is
// the item's slot at peer p (-1: none). Combine: the one entry is s * items + m of the partial,
// which goes back to source s at slot (this rank * items + m).
template <bool kCombine>
struct Destinations {
  const int32_t* entries;  // the item's map_words entries
  const ExchangeParams* ex;

  __device__ bool Any() const {
    if constexpr (kCombine) {
      return entries[0] >= 0;
    } else {
      bool any = false;
      for (int p = 0; p < ex->ranks; ++p) any = any || entries[p] >= 0;
      return any;
    }
  }
  // Calls f(peer, slot) for each destination.
  template <typename F>
  __device__ void ForEach(F&& f) const {
    if constexpr (kCombine) {
      const int32_t v = entries[0], items = static_cast<int32_t>(ex->items);  // < 2^31
      if (v >= 0) f(v / items, static_cast<int64_t>(ex->rank) * items + v % items);
    } else {
      for (int p = 0; p < ex->ranks; ++p) {
        const int32_t slot = entries[p];
        if (slot >= 0) f(p, static_cast<int64_t>(slot));
      }
    }
  }
};

// Bit i of the result: item i of the chunk goes somewhere (every lane gets the same mask).
template <bool kCombine>
__device__ uint64_t ChunkMask(const int32_t* map, const SendArgs& a) {
  uint64_t mask = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = Lane() + 32 * h;
    const Destinations<kCombine> d{map + i * a.map_words, &a.ex};
    mask |= static_cast<uint64_t>(__ballot_sync(kAllLanes, d.Any())) << (32 * h);
  }
  return mask;
}

// The piece `piece` of a row: [offset, offset + bytes).
__device__ __forceinline__ int64_t PieceOffset(const SendArgs& a, int64_t piece) {
  return piece * a.plan.stage_bytes;
}
__device__ __forceinline__ int64_t PieceBytes(int64_t row_bytes, const SendArgs& a, int64_t piece) {
  const int64_t left = row_bytes - PieceOffset(a, piece);
  return left < a.plan.stage_bytes ? left : a.plan.stage_bytes;
}

template <typename Word>
__device__ void WarpCopyWords(char* dst, const char* src, int64_t bytes) {
  const int64_t words = bytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t i = Lane(); i < words; i += 32) {
    reinterpret_cast<Word*>(dst)[i] = reinterpret_cast<const Word*>(src)[i];
  }
}

// A row piece into a stage by the lanes of a warp, the widest word the addresses allow.
__device__ void WarpLoadPiece(char* stage, const char* src, int64_t bytes) {
  switch (WordBytes(src, nullptr, bytes)) {
    case 16:
      return WarpCopyWords<uint4>(stage, src, bytes);
    case 8:
      return WarpCopyWords<uint2>(stage, src, bytes);
    case 4:
      return WarpCopyWords<uint32_t>(stage, src, bytes);
    case 2:
      return WarpCopyWords<uint16_t>(stage, src, bytes);
    default:
      return WarpCopyWords<uint8_t>(stage, src, bytes);
  }
}

// A staged token of kDtype [hidden] quantised in place into its wire row (payload, then block
// scales; fp8.h) by the lanes of a warp. Block b's payload lands on bytes the token's blocks
// before b occupied or, for b = 0, on its own: every lane has read those into registers before
// the __syncwarp that precedes the stores (the amax shuffles order no memory); the scales wait
// in `scales` until every block was read.
constexpr int kFp8PerLane = kFp8Block / 32;
static_assert(kFp8PerLane * 32 == kFp8Block);

template <Dtype kDtype>
__device__ void QuantizeStage(char* stage, int64_t hidden, float* scales) {
  const int first = Lane() * kFp8PerLane;
  for (int64_t begin = 0; begin < hidden; begin += kFp8Block) {
    const int64_t n = hidden - begin < kFp8Block ? hidden - begin : kFp8Block;
    float v[kFp8PerLane];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kFp8PerLane; ++i) {
      v[i] = first + i < n ? LoadAsFloat(stage, begin + first + i, kDtype) : 0.0f;
      amax = fmaxf(amax, FiniteMagnitude(v[i]));
    }
    const Fp8BlockScale s = BlockScale(WarpMax(amax));
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < kFp8PerLane; ++i) {
      packed |= static_cast<uint32_t>(QuantizeE4m3fn(v[i], s.inv)) << (8 * i);
    }
    __syncwarp();
    if (n == kFp8Block) {
      reinterpret_cast<uint32_t*>(stage + begin)[Lane()] = packed;
    } else {
#pragma unroll
      for (int i = 0; i < kFp8PerLane; ++i) {
        if (first + i < n) stage[begin + first + i] = static_cast<char>(packed >> (8 * i));
      }
    }
    if (Lane() == 0) scales[begin / kFp8Block] = s.scale;
  }
  __syncwarp();
  const int64_t scale_bytes = 4 * Fp8Blocks(hidden);
  const char* from = reinterpret_cast<const char*>(scales);
  for (int64_t i = Lane(); i < scale_bytes; i += 32) stage[hidden + i] = from[i];
}

// The S2G side of a staged piece: quantise (FP8), then one bulk store per destination.
template <bool kCombine, Dtype kDtype, bool kQuantize>
__device__ void StorePiece(const PeerWindows& peers, const SendArgs& a, char* stage, float* scales,
                           const Destinations<kCombine>& dests, int64_t piece,
                           uint64_t generation) {
  if constexpr (kQuantize) {
    QuantizeStage<kDtype>(stage, a.hidden, scales);
    FenceSharedForBulk();
    __syncwarp();
  }
  if (Lane() != 0) return;
  const int64_t offset = PieceOffset(a, piece);
  const uint32_t bytes = static_cast<uint32_t>(Round16(PieceBytes(a.ex.row_bytes, a, piece)));
  dests.ForEach([&](int peer, int64_t slot) {
    char* to = Payload(peers.base[peer], a.ex, generation) + slot * a.ex.window.slot_stride;
    BulkStore(to + offset, stage, bytes);
  });
  BulkCommit();
}

// At most kSendRegisters registers a thread (no spills: tests/cuda_sass_test.py reads the
// compiled module), so a send block takes 12 K of an SM's 64 K registers and leaves the rest to
// compute kernels running beside the transport on the same SM.
template <bool kCombine, Dtype kDtype, bool kQuantize>
__global__ void __maxnreg__(kSendRegisters)
    SendKernel(const __grid_constant__ PeerWindows peers, const SendArgs a) {
  JAX_HYBRIDEP_DYNAMIC_SHARED(char, smem, 128);
  JAX_HYBRIDEP_SHARED_ARRAY(uint64_t, full, kMaxStages, 8);
  JAX_HYBRIDEP_SHARED_ARRAY(uint64_t, empty, kMaxStages, 8);
  JAX_HYBRIDEP_SHARED_ARRAY(uint64_t, map_full, 2, 8);
  JAX_HYBRIDEP_SHARED_ARRAY(uint64_t, map_empty, 2, 8);
  const int warp = threadIdx.x / 32, lane = Lane();
  const int64_t stages = a.plan.stages, pieces = a.plan.pieces;
  int32_t* maps = reinterpret_cast<int32_t*>(smem);
  char* ring = smem + Round128(2 * a.plan.map_bytes);
  const int64_t map_ints = a.plan.map_bytes / 4;
  char* own = a.ex.own;
  const uint64_t generation = Generation(own, a.ex);
  const int64_t items = kCombine ? a.received[0] : a.ex.items;
  const int64_t chunks = (items + kSendChunk - 1) / kSendChunk;
  const int64_t blocks = gridDim.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      BarrierInit(&full[s], 1);
      BarrierInit(&empty[s], 1);
    }
    for (int s = 0; s < 2; ++s) {
      BarrierInit(&map_full[s], 1);
      BarrierInit(&map_empty[s], 1 + kS2GWarps);
    }
    ptx::FenceMbarrierInit();
  }
  __syncthreads();
  auto load_map = [&](int64_t i, int64_t chunk) {  // the elected lane of the G2S warp
    const int slot = i & 1;
    BarrierWait(&map_empty[slot], ((i >> 1) & 1) ^ 1);
    BarrierExpectBytes(&map_full[slot], static_cast<uint32_t>(a.plan.map_bytes));
    BulkLoad(maps + slot * map_ints, a.map + chunk * map_ints,
             static_cast<uint32_t>(a.plan.map_bytes), &map_full[slot]);
  };

  if (warp == 0) {  // G2S
    if (lane == 0 && blockIdx.x < chunks) load_map(0, blockIdx.x);
    int64_t unit = 0;
    for (int64_t i = 0, chunk = blockIdx.x; chunk < chunks; ++i, chunk += blocks) {
      const int32_t* map = maps + (i & 1) * map_ints;
      BarrierWait(&map_full[i & 1], (i >> 1) & 1);
      uint64_t mask = ChunkMask<kCombine>(map, a);
      const bool next = chunk + blocks < chunks;
      // The next chunk's map, once the S2G warps are past the previous chunk (about a ring's
      // worth of this chunk's rows later, or at its end).
      int64_t until_prefetch = stages;
      for (; mask != 0; mask &= mask - 1) {
        const int item = __ffsll(static_cast<long long>(mask)) - 1;
        const char* row = a.src + (chunk * kSendChunk + item) * a.src_row_bytes;
        for (int64_t piece = 0; piece < pieces; ++piece, ++unit) {
          const int s = unit % stages;
          BarrierWait(&empty[s], ((unit / stages) & 1) ^ 1);
          char* stage = ring + s * a.plan.stage_bytes;
          const int64_t bytes = PieceBytes(a.src_row_bytes, a, piece);
          if (a.bulk_load) {
            if (lane == 0) {
              BarrierExpectBytes(&full[s], static_cast<uint32_t>(bytes));
              BulkLoad(stage, row + PieceOffset(a, piece), static_cast<uint32_t>(bytes), &full[s]);
            }
            // Every lane waited for this stage: none may fall a ring behind lane 0, or its next
            // parity wait would be for a phase the barrier has passed twice (a lane blocked for
            // ever; lanes are not in lockstep).
            __syncwarp();
          } else {
            WarpLoadPiece(stage, row + PieceOffset(a, piece), bytes);
            FenceSharedForBulk();
            __syncwarp();
            if (lane == 0) BarrierArrive(&full[s]);
          }
        }
        if (--until_prefetch == 0 && next && lane == 0) load_map(i + 1, chunk + blocks);
      }
      if (until_prefetch > 0 && next && lane == 0) load_map(i + 1, chunk + blocks);
      __syncwarp();
      if (lane == 0) BarrierArrive(&map_empty[i & 1]);
    }
  } else {  // S2G
    const int me = warp - 1;
    float* scales =
        reinterpret_cast<float*>(ring + stages * a.plan.stage_bytes + me * a.plan.scale_bytes);
    int64_t unit = 0;
    int pending = -1;  // the stage of the newest committed group (lane 0)
    for (int64_t i = 0, chunk = blockIdx.x; chunk < chunks; ++i, chunk += blocks) {
      const int32_t* map = maps + (i & 1) * map_ints;
      BarrierWait(&map_full[i & 1], (i >> 1) & 1);
      for (uint64_t mask = ChunkMask<kCombine>(map, a); mask != 0; mask &= mask - 1) {
        const int item = __ffsll(static_cast<long long>(mask)) - 1;
        const Destinations<kCombine> dests{map + item * a.map_words, &a.ex};
        for (int64_t piece = 0; piece < pieces; ++piece, ++unit) {
          if (unit % kS2GWarps != me) continue;
          const int s = unit % stages;
          BarrierWait(&full[s], (unit / stages) & 1);
          StorePiece<kCombine, kDtype, kQuantize>(peers, a, ring + s * a.plan.stage_bytes, scales,
                                                  dests, piece, generation);
          if (lane == 0) {
            if (pending >= 0) {
              BulkWaitRead<1>();
              BarrierArrive(&empty[pending]);
            }
            pending = s;
          }
          __syncwarp();  // no lane a ring behind lane 0 (as in the G2S warp)
        }
      }
      __syncwarp();
      if (lane == 0) BarrierArrive(&map_empty[i & 1]);
    }
    if (lane == 0) {
      BulkWaitAll();
      __threadfence_system();
    }
  }
  SignalPeers(peers, a.ex, Tag(generation, a.ex.site));
}

template <bool kCombine, Dtype kDtype, bool kQuantize>
cudaError_t Launch(const PeerWindows& peers, const SendArgs& a, cudaStream_t stream) {
  auto kernel = &SendKernel<kCombine, kDtype, kQuantize>;
  cudaError_t s = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(a.plan.smem_bytes));
  if (s != cudaSuccess) return s;
  return LaunchKernel(kernel, dim3(static_cast<unsigned>(a.ex.send_blocks)), dim3(kSendThreads),
                      static_cast<size_t>(a.plan.smem_bytes), stream, peers, a);
}

// The dynamic shared memory a send block may opt into on this device (at most kSharedBudget:
// the plan tests check is the one an H200 runs).
int64_t DeviceBudget() {
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    cudaGetLastError();
    return kSharedBudget;
  }
  return std::min<int64_t>(optin, kSharedBudget);
}

cudaError_t CheckExchange(const ExchangeParams& ex) {
  if (ex.send_blocks < 1 || ex.send_blocks > kMaxSendBlocks || ex.ranks < 1 ||
      ex.ranks > kMaxWindowRanks || ex.rank < 0 || ex.rank >= ex.ranks ||
      ex.row_bytes > ex.window.slot_stride) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchSendRows(const ExchangeParams& ex, const PeerWindows& peers, const char* x,
                           int64_t x_row_bytes, const int32_t* send_slot, Dtype fp8_dtype,
                           int64_t fp8_hidden, cudaStream_t stream) {
  if (cudaError_t s = CheckExchange(ex); s != cudaSuccess) return s;
  const bool quantize = fp8_hidden > 0;
  if (quantize && (ex.row_bytes != Fp8WireBytes(fp8_hidden) ||
                   x_row_bytes != fp8_hidden * DtypeBytes(fp8_dtype))) {
    return cudaErrorInvalidValue;
  }
  if (!quantize && x_row_bytes != ex.row_bytes) return cudaErrorInvalidValue;
  SendArgs a{};
  a.ex = ex;
  a.src = x;
  a.src_row_bytes = x_row_bytes;
  a.map = send_slot;
  a.map_words = ex.ranks;
  a.bulk_load = reinterpret_cast<uintptr_t>(x) % 16 == 0 && x_row_bytes % 16 == 0;
  a.hidden = fp8_hidden;
  a.plan = PlanSend(x_row_bytes, ex.ranks, fp8_hidden, DeviceBudget());
  if (a.plan.stages == 0) return cudaErrorInvalidValue;
  if (!quantize) return Launch<false, Dtype::kF32, false>(peers, a, stream);
  switch (fp8_dtype) {
    case Dtype::kF32:
      return Launch<false, Dtype::kF32, true>(peers, a, stream);
    case Dtype::kBF16:
      return Launch<false, Dtype::kBF16, true>(peers, a, stream);
    case Dtype::kF16:
      return Launch<false, Dtype::kF16, true>(peers, a, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchSendPartials(const ExchangeParams& ex, const PeerWindows& peers,
                               const char* partials, const int32_t* recv_item, const int32_t* info,
                               cudaStream_t stream) {
  if (cudaError_t s = CheckExchange(ex); s != cudaSuccess) return s;
  SendArgs a{};
  a.ex = ex;
  a.src = partials;
  a.src_row_bytes = ex.row_bytes;
  a.map = recv_item;
  a.map_words = 1;
  a.received = info;
  a.bulk_load = reinterpret_cast<uintptr_t>(partials) % 16 == 0 && ex.row_bytes % 16 == 0;
  a.plan = PlanSend(ex.row_bytes, 1, 0, DeviceBudget());
  if (a.plan.stages == 0) return cudaErrorInvalidValue;
  return Launch<true, Dtype::kF32, false>(peers, a, stream);
}

// Read by the test module only (declared in lab/native/cuda/introspection.h).
cudaError_t GetSendKernelInfo(int* registers, int64_t* static_smem, int64_t* max_dynamic_smem) {
  cudaFuncAttributes attrs;
  cudaError_t s = cudaFuncGetAttributes(&attrs, &SendKernel<false, Dtype::kF32, false>);
  if (s != cudaSuccess) return s;
  *registers = attrs.numRegs;
  *static_smem = static_cast<int64_t>(attrs.sharedSizeBytes);
  int device = 0, optin = 0;
  s = cudaGetDevice(&device);
  if (s == cudaSuccess) {
    s = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  *max_dynamic_smem = optin - *static_smem;
  return s;
}

}  // namespace jax_hybridep
