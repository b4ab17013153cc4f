// The direct-write transport's device phases (transport.h): the dispatch send (plain, Hopper's
// warp-specialised bulk-copy pipeline, or quantising to FP8), the receive that expands slots into
// expert-major rows, combine's partial sums and their reduction, and row values. Each phase is
// written for one block of one rank; the per-rank kernels (transport_kernels.cu) run one phase per
// launch, the virtual-rank harness (testing/transport_harness.cu) every rank's in one launch.
// Device code is compiled into every .cu file that includes it (whole-program CUDA, no device
// linking), so it has internal linkage here.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_TRANSPORT_PHASES_CUH_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_TRANSPORT_PHASES_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "xla_ffi/cuda/bulk_copy.cuh"
#include "xla_ffi/cuda/transport.h"
#include "xla_ffi/cuda/transport_sync.cuh"
#include "xla_ffi/cuda/warp_rows.cuh"
#include "xla_ffi/fp8.h"

namespace jax_hybridep {
namespace {

// Send blocks: one loader warp (bulk copies into a shared-memory ring on Hopper) and writer warps
// (stores to the destinations). Without the bulk path every warp copies.
constexpr int kWriterWarps = 8;
constexpr int kThreads = 32 * (kWriterWarps + 1);
constexpr int kStages = 5;
constexpr int kChunkBytes = 8192;
// 40 KiB: with the kernels' static shared memory it stays under the 48 KiB a block gets without
// opting in (exactly 48 KiB of dynamic memory plus any static would fail to launch).
constexpr int kRingBytes = kStages * kChunkBytes;
constexpr int kWarps = kThreads / 32;

__device__ char* PayloadSlot(const ExchangeContext& ctx, int64_t d, int64_t src, int64_t t) {
  const int64_t parity = ctx.generation & 1;
  return ctx.windows[d].payload[parity] + (src * ctx.tokens + t) * RowStride(ctx.row_bytes);
}

// Token t's slots in the windows of its distinct destinations (first occurrences of dest_t).
__device__ WarpList DestinationSlots(const ExchangeContext& ctx, const int32_t* dest_t, int64_t t) {
  int32_t d[2];
  LoadEntries(dest_t, ctx.k, d);
  bool first[2] = {d[0] >= 0, d[1] >= 0};
  for (int i = 0; i < ctx.k; ++i) {
    const int32_t di = ShuffleEntry(d, i);
#pragma unroll
    for (int h = 0; h < 2; ++h) first[h] = first[h] && !(i < Lane() + 32 * h && di == d[h]);
  }
  char* slot[2];
  const float unused[2] = {1.0f, 1.0f};
#pragma unroll
  for (int h = 0; h < 2; ++h) slot[h] = first[h] ? PayloadSlot(ctx, d[h], ctx.rank, t) : nullptr;
  return Compact(slot, unused, first);
}

// ----------------------------------------------------------------------------- dispatch send

// Every destination's metadata for token t of this rank: its rows of t (-1 elsewhere) and their
// weights, written by `threads` threads from `tid` (every token, so stale slots never survive).
__device__ void SendMetadata(const ExchangeContext& ctx, int64_t t, const int32_t* dest,
                             const int32_t* row_pos, const float* weights, int tid, int threads) {
  const int64_t K = ctx.k, parity = ctx.generation & 1;
  const int64_t slot = (ctx.rank * ctx.tokens + t) * K;
  for (int64_t i = tid; i < ctx.ranks * K; i += threads) {
    const int64_t d = i / K, j = i % K;
    const bool here = dest[t * K + j] == d;
    const Window& w = ctx.windows[d];
    w.row_pos[parity][slot + j] = here ? row_pos[t * K + j] : -1;
    w.values[parity][slot + j] = here && weights != nullptr ? weights[t * K + j] : 0.0f;
  }
}

// This block's tokens t = block (mod send_blocks), every warp its share: t = block +
// send_blocks * (warp + kWarps * n).
#define FOR_WARP_TOKENS(t, ctx, block)                                                   \
  for (int64_t t = (block) + (ctx).send_blocks * static_cast<int64_t>(threadIdx.x / 32); \
       t < (ctx).tokens; t += (ctx).send_blocks * kWarps)

// Plain path: a warp per token loads words of x[t] and stores each to every destination of t.
__device__ void SendTokensPlain(const ExchangeContext& ctx, int64_t block, const char* x,
                                const int32_t* dest, const int32_t* row_pos, const float* weights) {
  const int word = WordBytes(x, nullptr, ctx.row_bytes);
  FOR_WARP_TOKENS(t, ctx, block) {
    if (row_pos != nullptr) SendMetadata(ctx, t, dest, row_pos, weights, Lane(), 32);
    const WarpList slots = DestinationSlots(ctx, dest + t * ctx.k, t);
    WarpFanOut(word, x + t * ctx.row_bytes, ctx.row_bytes, slots);
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// 16-byte words of a chunk each writer thread stores.
constexpr int kChunkWordsPerThread = kChunkBytes / 16 / (32 * kWriterWarps);
static_assert(kChunkWordsPerThread * 16 * 32 * kWriterWarps == kChunkBytes);

// Warp 0 (one lane issuing) streams the block's token rows chunk by chunk into a ring of kStages
// slots; writer warps store each chunk to every destination of its token and hand the slot back.
// A token is read from HBM once whatever its number of destinations. Each writer warp reads the
// token's destinations once into registers. Needs row_bytes % 16 == 0 and a 16-byte aligned x.
__device__ void SendTokensBulk(const ExchangeContext& ctx, int64_t block, const char* x,
                               const int32_t* dest, const int32_t* row_pos, const float* weights) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int warp = threadIdx.x / 32, lane = Lane();
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      BarrierInit(&full[s], 1);
      BarrierInit(&empty[s], kWriterWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int64_t chunks = (ctx.row_bytes + kChunkBytes - 1) / kChunkBytes;
  int64_t item = 0;  // (token, chunk) pairs in this block's order: the same walk in every warp
  if (warp == 0) {
    for (int64_t t = block; t < ctx.tokens; t += ctx.send_blocks) {
      int32_t d[2];
      LoadEntries(dest + t * ctx.k, ctx.k, d);
      if (!__any_sync(kAllLanes, d[0] >= 0 || d[1] >= 0)) continue;
      for (int64_t c = 0; c < chunks; ++c, ++item) {
        if (lane != 0) continue;
        const int s = item % kStages;
        const uint32_t phase = (item / kStages) & 1;
        const int64_t offset = c * kChunkBytes;
        const uint32_t bytes = static_cast<uint32_t>(
            ctx.row_bytes - offset < kChunkBytes ? ctx.row_bytes - offset : kChunkBytes);
        BarrierWait(&empty[s], phase ^ 1);
        BarrierExpectBytes(&full[s], bytes);
        BulkLoad(ring + s * kChunkBytes, x + t * ctx.row_bytes + offset, bytes, &full[s]);
      }
      __syncwarp();  // lane 0 rejoins before the next token's vote
    }
  } else {
    const int tid = threadIdx.x - 32, threads = 32 * kWriterWarps;
    for (int64_t t = block; t < ctx.tokens; t += ctx.send_blocks) {
      if (row_pos != nullptr) SendMetadata(ctx, t, dest, row_pos, weights, tid, threads);
      const WarpList slots = DestinationSlots(ctx, dest + t * ctx.k, t);
      if (slots.n == 0) continue;
      for (int64_t c = 0; c < chunks; ++c, ++item) {
        const int s = item % kStages;
        const uint32_t phase = (item / kStages) & 1;
        const int64_t offset = c * kChunkBytes;
        const int64_t words =
            (ctx.row_bytes - offset < kChunkBytes ? ctx.row_bytes - offset : kChunkBytes) / 16;
        BarrierWait(&full[s], phase);
        const uint4* chunk = reinterpret_cast<const uint4*>(ring + s * kChunkBytes);
        uint4 v[kChunkWordsPerThread];
#pragma unroll
        for (int b = 0; b < kChunkWordsPerThread; ++b) {
          if (tid + b * threads < words) v[b] = chunk[tid + b * threads];
        }
        __syncwarp();
        if (lane == 0) BarrierArrive(&empty[s]);  // the slot is in registers now
        for (int i = 0; i < slots.n; ++i) {
          uint4* out = reinterpret_cast<uint4*>(EntryPtr(slots, i) + offset);
#pragma unroll
          for (int b = 0; b < kChunkWordsPerThread; ++b) {
            if (tid + b * threads < words) out[tid + b * threads] = v[b];
          }
        }
      }
    }
  }
}
#endif

__device__ void SendTokensPhase(const ExchangeContext& ctx, int64_t block, const char* x,
                                const int32_t* dest, const int32_t* row_pos, const float* weights) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (ctx.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    SendTokensBulk(ctx, block, x, dest, row_pos, weights);
    SignalBlockDone(ctx, block);
    return;
  }
#endif
  SendTokensPlain(ctx, block, x, dest, row_pos, weights);
  SignalBlockDone(ctx, block);
}

// The quantising send (transport.h): a warp per token, as the plain path.
template <Dtype kDtype>
__device__ void SendTokensQuantizedPhase(const ExchangeContext& ctx, int64_t block, int64_t hidden,
                                         const char* x, const int32_t* dest, const int32_t* row_pos,
                                         const float* weights) {
  const int64_t x_row_bytes = hidden * DtypeBytes(kDtype);
  FOR_WARP_TOKENS(t, ctx, block) {
    if (row_pos != nullptr) SendMetadata(ctx, t, dest, row_pos, weights, Lane(), 32);
    const WarpList slots = DestinationSlots(ctx, dest + t * ctx.k, t);
    if (slots.n > 0) WarpQuantizeFanOut<kDtype>(x + t * x_row_bytes, hidden, slots);
  }
  SignalBlockDone(ctx, block);
}

// ----------------------------------------------------------------------------- dispatch receive

// How a received payload slot becomes rows: copied as it is (any row, FP8 wire rows included)...
struct CopyRows {
  int64_t row_bytes;
  int word;  // the widest access the rows allow (payload slots are 16-byte aligned)

  __device__ int64_t OutRowBytes() const { return row_bytes; }
  __device__ void operator()(const char* payload, const WarpList& rows) const {
    WarpFanOut(word, payload, row_bytes, rows);
  }
};

// ... or, a wire row of `hidden` elements, dequantised into rows of kDtype.
template <Dtype kDtype>
struct DequantizeRows {
  int64_t hidden;

  __device__ int64_t OutRowBytes() const { return hidden * DtypeBytes(kDtype); }
  __device__ void operator()(const char* payload, const WarpList& rows) const {
    WarpDequantizeFanOut<kDtype>(payload, hidden, rows);
  }
};

// Receiving block `block` expands the slots (src, t) with t = block (mod send_blocks), source by
// source, each after its sender block's flag; a warp per slot. Returns false when a wait failed.
template <typename Expand>
__device__ bool ReceiveRowsPhase(const ExchangeContext& ctx, int64_t block, char* out_tokens,
                                 float* out_weights, int32_t* recv_row_pos, const Expand& expand) {
  const int64_t T = ctx.tokens, K = ctx.k, parity = ctx.generation & 1;
  const Window& self = ctx.windows[ctx.rank];
  for (int64_t src = 0; src < ctx.ranks; ++src) {
    if (!BlockWaitArrived(ctx, src, block)) return false;
    FOR_WARP_TOKENS(t, ctx, block) {
      const int64_t slot = src * T + t;
      int32_t rows[2];
      LoadEntries(self.row_pos[parity] + slot * K, K, rows);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t j = Lane() + 32 * h;
        if (j >= K) continue;
        recv_row_pos[slot * K + j] = rows[h];
        if (rows[h] >= 0) out_weights[rows[h]] = self.values[parity][slot * K + j];
      }
      expand(PayloadSlot(ctx, ctx.rank, src, t),
             RowList(rows, out_tokens, expand.OutRowBytes(), nullptr));
    }
  }
  return true;
}

__device__ CopyRows CopyRowsTo(const ExchangeContext& ctx, const char* out_tokens) {
  return CopyRows{ctx.row_bytes, WordBytes(out_tokens, nullptr, ctx.row_bytes)};
}

// Redispatch receive: rows from the dispatch's recv_row_pos, and the scaled rows elementwise.
template <Dtype kDtype>
__device__ bool ReceiveRedispatchPhase(const ExchangeContext& ctx, int64_t block,
                                       const int32_t* recv_row_pos, const float* scale,
                                       char* out_tokens, char* out_scaled) {
  const int64_t T = ctx.tokens, K = ctx.k;
  const int64_t hidden = ctx.row_bytes / DtypeBytes(kDtype);
  const int word = WordBytes(out_tokens, nullptr, ctx.row_bytes);
  const bool wide = WordBytes(out_scaled, nullptr, ctx.row_bytes) == 16;
  for (int64_t src = 0; src < ctx.ranks; ++src) {
    if (!BlockWaitArrived(ctx, src, block)) return false;
    FOR_WARP_TOKENS(t, ctx, block) {
      int32_t rows[2];
      LoadEntries(recv_row_pos + (src * T + t) * K, K, rows);
      const char* payload = PayloadSlot(ctx, ctx.rank, src, t);
      WarpFanOut(word, payload, ctx.row_bytes, RowList(rows, out_tokens, ctx.row_bytes, nullptr));
      if (scale == nullptr) continue;
      const WarpList scaled = RowList(rows, out_scaled, ctx.row_bytes, scale);
      for (int i = 0; i < scaled.n; ++i) {
        char* out = EntryPtr(scaled, i);
        const float factor = EntryFactor(scaled, i);
        if (wide) {
          WarpScaleRow<kDtype, kLanes<kDtype>>(payload, factor, hidden, out);
        } else {
          WarpScaleRow<kDtype, 1>(payload, factor, hidden, out);
        }
      }
    }
  }
  return true;
}

// ----------------------------------------------------------------------------- combine

// Destination side: each received (src, t) gets its partial (the float32 sum over ascending k of
// its rows of y, times their weights, rounded to kDtype), written into src's window at [this
// rank, t]. Block `block` handles t = block (mod send_blocks) of every source, a warp per item.
// Rows of a multiple of 16 bytes in a 16-byte aligned y move 16 bytes per access.
template <Dtype kDtype>
__device__ void SendPartialsPhase(const ExchangeContext& ctx, int64_t block, const char* y,
                                  const float* weights, const int32_t* recv_row_pos) {
  const int64_t T = ctx.tokens, K = ctx.k;
  const int64_t hidden = ctx.row_bytes / DtypeBytes(kDtype);
  const bool wide = WordBytes(y, nullptr, ctx.row_bytes) == 16;
  const int64_t per_source = (T - block + ctx.send_blocks - 1) / ctx.send_blocks;
  for (int64_t item = threadIdx.x / 32; item < ctx.ranks * per_source; item += kWarps) {
    const int64_t src = item / per_source, t = block + (item % per_source) * ctx.send_blocks;
    int32_t rows[2];
    LoadEntries(recv_row_pos + (src * T + t) * K, K, rows);
    const WarpList list = RowList(rows, const_cast<char*>(y), ctx.row_bytes, weights);
    if (list.n == 0) continue;
    char* out = ctx.windows[src].payload[ctx.generation & 1] +
                (ctx.rank * T + t) * RowStride(ctx.row_bytes);
    WarpSumRowsAnyWidth<kDtype>(list, weights != nullptr, wide, hidden, out);
  }
  SignalBlockDone(ctx, block);
}

// OR of v over the lanes of a warp.
__device__ unsigned WarpOr(unsigned v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v |= __shfl_xor_sync(kAllLanes, v, offset);
  return v;
}

// Token t's partials in this rank's window, one per distinct destination in ascending rank.
__device__ WarpList PartialsOf(const ExchangeContext& ctx, const int32_t* dest_t, int64_t t) {
  constexpr int kRankWords = kMaxWindowRanks / 32;
  int32_t d[2];
  LoadEntries(dest_t, ctx.k, d);
  unsigned ranks[kRankWords];  // the set of destinations, as bits
#pragma unroll
  for (int w = 0; w < kRankWords; ++w) {
    unsigned bits = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) bits |= d[h] >= 0 && d[h] / 32 == w ? 1u << (d[h] % 32) : 0u;
    ranks[w] = WarpOr(bits);
  }
  const char* partials = ctx.windows[ctx.rank].payload[ctx.generation & 1];
  WarpList list;
  list.n = 0;
#pragma unroll
  for (int w = 0; w < kRankWords; ++w) list.n += __popc(ranks[w]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = Lane() + 32 * h;
    int before = 0, rank = -1;
#pragma unroll
    for (int w = 0; w < kRankWords; ++w) {
      const int count = __popc(ranks[w]);
      if (rank < 0 && i < before + count) rank = 32 * w + NthSetBit(ranks[w], i - before);
      before += count;
    }
    list.ptr[h] =
        rank < 0 ? nullptr
                 : const_cast<char*>(partials) + (rank * ctx.tokens + t) * RowStride(ctx.row_bytes);
    list.factor[h] = 1.0f;
  }
  return list;
}

// Source side: out[t] = sum of its partials over its distinct destinations in ascending rank. The
// block first waits for every peer's flag: the sums need them, and the next send may reuse the
// other half of the peers' windows only after they were all seen (transport.h).
template <Dtype kDtype>
__device__ bool ReducePartialsPhase(const ExchangeContext& ctx, int64_t block, const int32_t* dest,
                                    char* out) {
  __shared__ int ok;
  __syncthreads();  // `ok` may still be read from the previous call.
  if (threadIdx.x == 0) {
    ok = 1;
    for (int64_t d = 0; d < ctx.ranks && ok; ++d) ok = WaitArrived(ctx, d, block);
  }
  __syncthreads();
  if (!ok) return false;
  const int64_t hidden = ctx.row_bytes / DtypeBytes(kDtype);
  const bool wide = WordBytes(out, nullptr, ctx.row_bytes) == 16;
  FOR_WARP_TOKENS(t, ctx, block) {
    const WarpList partials = PartialsOf(ctx, dest + t * ctx.k, t);
    WarpSumRowsAnyWidth<kDtype>(partials, false, wide, hidden, out + t * ctx.row_bytes);
  }
  return true;
}

// ----------------------------------------------------------------------------- row values

__device__ void SendRowValuesPhase(const ExchangeContext& ctx, int64_t block, const float* values,
                                   const int32_t* recv_row_pos) {
  const int64_t T = ctx.tokens, K = ctx.k;
  for (int64_t src = 0; src < ctx.ranks; ++src) {
    float* out = ctx.windows[src].values[ctx.generation & 1] + ctx.rank * T * K;
    for (int64_t t = block; t < T; t += ctx.send_blocks) {
      const int32_t* rows = recv_row_pos + (src * T + t) * K;
      for (int64_t j = threadIdx.x; j < K; j += blockDim.x) {
        if (rows[j] >= 0) out[t * K + j] = values[rows[j]];
      }
    }
  }
  SignalBlockDone(ctx, block);
}

__device__ bool ReceiveRowValuesPhase(const ExchangeContext& ctx, int64_t block,
                                      const int32_t* dest, float* out) {
  const int64_t T = ctx.tokens, K = ctx.k;
  const float* values = ctx.windows[ctx.rank].values[ctx.generation & 1];
  for (int64_t d = 0; d < ctx.ranks; ++d) {
    if (!BlockWaitArrived(ctx, d, block)) return false;
  }
  for (int64_t t = block; t < T; t += ctx.send_blocks) {
    for (int64_t j = threadIdx.x; j < K; j += blockDim.x) {
      const int32_t d = dest[t * K + j];
      out[t * K + j] = d >= 0 ? values[(d * T + t) * K + j] : 0.0f;
    }
  }
  return true;
}

}  // namespace
}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_TRANSPORT_PHASES_CUH_
