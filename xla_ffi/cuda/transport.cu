// The direct-write transport's device code (transport.h): send and receive phases, flags with
// timeouts, the warp-specialised bulk-copy pipeline of the dispatch send, and the virtual-rank
// harness. Results are bitwise those of the host steps (exchange.h): sums use __fadd_rn /
// __fmul_rn in the host's order and 16-bit values go through numeric.h's conversions.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "xla_ffi/cuda/transport.h"
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
// A spinning wait checks whether another wait already failed this often (a mapped-host read).
constexpr int kPollsPerErrorCheck = 1024;

constexpr size_t kAlign = 256;

size_t AlignUp(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// ----------------------------------------------------------------------------- flags and waits

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

// ----------------------------------------------------------------------------- warp lists

// The row kernels work a warp per token (or item): the lanes read the token's K routing entries
// once into registers and pass row addresses by shuffles, and the copy loops keep several 16-byte
// loads per lane in flight before their stores. (Block-wide loops that re-read the row list from
// memory for every word ran at 4 GB/s of dispatch payload per SM on an H200; docs/benchmarks.md.)
constexpr unsigned kAllLanes = 0xffffffffu;
constexpr int kWarps = kThreads / 32;
// 16-byte words (or element groups) a lane loads before it stores or adds them.
constexpr int kWordsInFlight = 8;

__device__ int Lane() { return static_cast<int>(threadIdx.x % 32); }

// Up to 64 entries (K <= 64) held by a warp: entry i lives in lane i % 32 of half i / 32; `n` is
// the same in every lane.
struct WarpList {
  char* ptr[2];
  float factor[2];
  int n;
};

template <typename T>
__device__ T ShuffleEntry(const T (&v)[2], int i) {
  return i < 32 ? __shfl_sync(kAllLanes, v[0], i) : __shfl_sync(kAllLanes, v[1], i - 32);
}

__device__ char* EntryPtr(const WarpList& list, int i) {
  const unsigned long long halves[2] = {reinterpret_cast<uintptr_t>(list.ptr[0]),
                                        reinterpret_cast<uintptr_t>(list.ptr[1])};
  return reinterpret_cast<char*>(static_cast<uintptr_t>(ShuffleEntry(halves, i)));
}

__device__ float EntryFactor(const WarpList& list, int i) { return ShuffleEntry(list.factor, i); }

// Position of the (n + 1)-th set bit of m (n < popcount(m)).
__device__ int NthSetBit(unsigned m, int n) {
  int pos = 0;
#pragma unroll
  for (int width = 16; width > 0; width /= 2) {
    const int low = __popc(m & ((1u << width) - 1u));
    if (n >= low) {
      n -= low;
      m >>= width;
      pos += width;
    }
  }
  return pos;
}

// The entries j = lane + 32 h with keep[h], in ascending j, moved to the front of the list.
__device__ WarpList Compact(char* const (&ptr)[2], const float (&factor)[2],
                            const bool (&keep)[2]) {
  const unsigned kept[2] = {__ballot_sync(kAllLanes, keep[0]), __ballot_sync(kAllLanes, keep[1])};
  const int first_half = __popc(kept[0]);
  WarpList list;
  list.n = first_half + __popc(kept[1]);
  const unsigned long long p[2] = {reinterpret_cast<uintptr_t>(ptr[0]),
                                   reinterpret_cast<uintptr_t>(ptr[1])};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = Lane() + 32 * h;
    const bool in_first = i < first_half;
    const int src =
        in_first ? NthSetBit(kept[0], i) : (i < list.n ? NthSetBit(kept[1], i - first_half) : 0);
    const unsigned long long a = __shfl_sync(kAllLanes, p[0], src);
    const unsigned long long b = __shfl_sync(kAllLanes, p[1], src);
    const float fa = __shfl_sync(kAllLanes, factor[0], src);
    const float fb = __shfl_sync(kAllLanes, factor[1], src);
    list.ptr[h] = reinterpret_cast<char*>(static_cast<uintptr_t>(in_first ? a : b));
    list.factor[h] = in_first ? fa : fb;
  }
  return list;
}

// A token's K entries (-1 past K) in the lanes: entry j = lane + 32 h in e[h].
__device__ void LoadEntries(const int32_t* entries, int64_t K, int32_t (&e)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t j = Lane() + 32 * h;
    e[h] = j < K ? entries[j] : -1;
  }
}

// Rows of `base` (stride bytes apart) for the entries >= 0, in ascending j, with factor[row]
// (1 when factor is null).
__device__ WarpList RowList(const int32_t (&rows)[2], char* base, int64_t stride,
                            const float* factor) {
  char* ptr[2];
  float f[2];
  bool keep[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    keep[h] = rows[h] >= 0;
    ptr[h] = keep[h] ? base + rows[h] * stride : nullptr;
    f[h] = keep[h] && factor != nullptr ? factor[rows[h]] : 1.0f;
  }
  return Compact(ptr, f, keep);
}

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

// ----------------------------------------------------------------------------- row copies

// One source row to every row of the list, `Word` bytes at a time by the lanes of a warp: each
// word is read once.
template <typename Word>
__device__ void WarpFanOutWords(const char* src, int64_t bytes, const WarpList& rows) {
  const int64_t words = bytes / static_cast<int64_t>(sizeof(Word));
  const Word* s = reinterpret_cast<const Word*>(src);
  // The trip count is the warp's, not the lane's: every lane must reach the shuffles.
  for (int64_t base = 0; base < words; base += 32 * kWordsInFlight) {
    const int64_t w0 = base + Lane();
    Word v[kWordsInFlight];
#pragma unroll
    for (int b = 0; b < kWordsInFlight; ++b) {
      if (w0 + 32 * b < words) v[b] = s[w0 + 32 * b];
    }
    for (int i = 0; i < rows.n; ++i) {
      Word* out = reinterpret_cast<Word*>(EntryPtr(rows, i));
#pragma unroll
      for (int b = 0; b < kWordsInFlight; ++b) {
        if (w0 + 32 * b < words) out[w0 + 32 * b] = v[b];
      }
    }
  }
}

__device__ void WarpFanOut(int word_bytes, const char* src, int64_t bytes, const WarpList& rows) {
  switch (word_bytes) {
    case 16:
      return WarpFanOutWords<uint4>(src, bytes, rows);
    case 8:
      return WarpFanOutWords<uint2>(src, bytes, rows);
    case 4:
      return WarpFanOutWords<uint32_t>(src, bytes, rows);
    case 2:
      return WarpFanOutWords<uint16_t>(src, bytes, rows);
    default:
      return WarpFanOutWords<uint8_t>(src, bytes, rows);
  }
}

// kN consecutive elements of a row as float32: one 16-byte access when kN > 1 (the element index
// must then be a multiple of kN and the row 16-byte aligned), else one element. The arithmetic on
// them is elementwise, so either width gives the same bits.
template <Dtype kDtype, int kN>
__device__ void LoadElements(const char* row, int64_t e, float (&v)[kN]) {
  if constexpr (kN == 1) {
    v[0] = LoadAsFloat(row, e, kDtype);
  } else {
    const uint4 word = *reinterpret_cast<const uint4*>(row + e * DtypeBytes(kDtype));
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = LoadAsFloat(&word, i, kDtype);
  }
}

template <Dtype kDtype, int kN>
__device__ void StoreElements(char* row, int64_t e, const float (&v)[kN]) {
  if constexpr (kN == 1) {
    StoreFromFloat(row, e, v[0], kDtype);
  } else {
    uint4 word;
#pragma unroll
    for (int i = 0; i < kN; ++i) StoreFromFloat(&word, i, v[i], kDtype);
    *reinterpret_cast<uint4*>(row + e * DtypeBytes(kDtype)) = word;
  }
}

// Elements of kDtype in 16 bytes.
template <Dtype kDtype>
constexpr int kLanes = kDtype == Dtype::kF32 ? 4 : 8;

// out[h] = in[h] * scale in float32, rounded to kDtype, by the lanes of a warp (fewer groups in
// flight than the copies: the floats take registers).
constexpr int kScaleInFlight = 4;

template <Dtype kDtype, int kN>
__device__ void WarpScaleRow(const char* in, float scale, int64_t hidden, char* out) {
  for (int64_t base = 0; base < hidden; base += 32 * kN * kScaleInFlight) {
    const int64_t e0 = base + Lane() * kN;
    float v[kScaleInFlight][kN];
#pragma unroll
    for (int b = 0; b < kScaleInFlight; ++b) {
      if (e0 + 32 * kN * b < hidden) LoadElements<kDtype, kN>(in, e0 + 32 * kN * b, v[b]);
    }
#pragma unroll
    for (int b = 0; b < kScaleInFlight; ++b) {
      if (e0 + 32 * kN * b >= hidden) continue;
#pragma unroll
      for (int i = 0; i < kN; ++i) v[b][i] = __fmul_rn(v[b][i], scale);
      StoreElements<kDtype, kN>(out, e0 + 32 * kN * b, v[b]);
    }
  }
}

// out = the float32 sum of the listed rows in list order (each times its factor when `scaled`),
// from +0 as the host starts, rounded once to kDtype; by the lanes of a warp, each lane loading
// kWordsInFlight element groups of a row before it adds them.
template <Dtype kDtype, int kN>
__device__ void WarpSumRows(const WarpList& rows, bool scaled, int64_t hidden, char* out) {
  constexpr int kGroups = kWordsInFlight;
  // The trip count is the warp's, not the lane's: every lane must reach the shuffles.
  for (int64_t base = 0; base < hidden; base += 32 * kN * kGroups) {
    const int64_t e0 = base + Lane() * kN;
    float acc[kGroups][kN] = {};
    for (int i = 0; i < rows.n; ++i) {
      const char* row = EntryPtr(rows, i);
      const float factor = EntryFactor(rows, i);
      float v[kGroups][kN] = {};
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        if (e0 + 32 * kN * g < hidden) LoadElements<kDtype, kN>(row, e0 + 32 * kN * g, v[g]);
      }
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
#pragma unroll
        for (int j = 0; j < kN; ++j) {
          acc[g][j] = __fadd_rn(acc[g][j], scaled ? __fmul_rn(v[g][j], factor) : v[g][j]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      if (e0 + 32 * kN * g < hidden) StoreElements<kDtype, kN>(out, e0 + 32 * kN * g, acc[g]);
    }
  }
}

// WarpSumRows with 16-byte accesses when every row and `out` allow them.
template <Dtype kDtype>
__device__ void WarpSumRowsAnyWidth(const WarpList& rows, bool scaled, bool wide, int64_t hidden,
                                    char* out) {
  if (wide) {
    WarpSumRows<kDtype, kLanes<kDtype>>(rows, scaled, hidden, out);
  } else {
    WarpSumRows<kDtype, 1>(rows, scaled, hidden, out);
  }
}

// ----------------------------------------------------------------------------- FP8 rows

// A warp takes a 128-element block of a token at a time, kFp8PerLane consecutive elements a lane.
constexpr int kFp8PerLane = kFp8Block / 32;
static_assert(kFp8PerLane * 32 == kFp8Block);

// Max of v over the lanes of a warp (v >= 0 and finite: the order does not change the bits).
__device__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(kAllLanes, v, offset));
  return v;
}

// 4 bytes at a possibly unaligned address (a wire row's scales follow H payload bytes).
__device__ float LoadUnalignedFloat(const char* p) {
  uint32_t bits = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b) bits |= static_cast<uint32_t>(static_cast<uint8_t>(p[b])) << (8 * b);
  return BitsToFloat(bits);
}

__device__ void StoreUnalignedFloat(char* p, float v) {
  const uint32_t bits = FloatToBits(v);
#pragma unroll
  for (int b = 0; b < 4; ++b) p[b] = static_cast<char>((bits >> (8 * b)) & 0xffu);
}

// Token x [hidden] of kDtype quantised into its wire row (payload, then the block scales; fp8.h)
// and written to every slot of the list, by the lanes of a warp. The token is read once. Slots
// are 16-byte aligned, so a full block's payload goes 4 bytes a lane.
template <Dtype kDtype>
__device__ void WarpQuantizeFanOut(const char* x, int64_t hidden, const WarpList& slots) {
  const int first = Lane() * kFp8PerLane;
  for (int64_t begin = 0; begin < hidden; begin += kFp8Block) {
    const int64_t n = hidden - begin < kFp8Block ? hidden - begin : kFp8Block;
    float v[kFp8PerLane];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kFp8PerLane; ++i) {
      v[i] = first + i < n ? LoadAsFloat(x, begin + first + i, kDtype) : 0.0f;
      amax = fmaxf(amax, FiniteMagnitude(v[i]));
    }
    const Fp8BlockScale s = BlockScale(WarpMax(amax));
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < kFp8PerLane; ++i) {
      packed |= static_cast<uint32_t>(QuantizeE4m3fn(v[i], s.inv)) << (8 * i);
    }
    for (int r = 0; r < slots.n; ++r) {
      char* row = EntryPtr(slots, r);
      if (n == kFp8Block) {
        reinterpret_cast<uint32_t*>(row + begin)[Lane()] = packed;
      } else {
#pragma unroll
        for (int i = 0; i < kFp8PerLane; ++i) {
          if (first + i < n) row[begin + first + i] = static_cast<char>(packed >> (8 * i));
        }
      }
      if (Lane() == 0) StoreUnalignedFloat(row + hidden + 4 * (begin / kFp8Block), s.scale);
    }
  }
}

// A wire row of `hidden` elements dequantised (float32(q) * scale, rounded once to kDtype) into
// every row of the list, by the lanes of a warp.
template <Dtype kDtype>
__device__ void WarpDequantizeFanOut(const char* wire, int64_t hidden, const WarpList& rows) {
  const int first = Lane() * kFp8PerLane;
  for (int64_t begin = 0; begin < hidden; begin += kFp8Block) {
    const int64_t n = hidden - begin < kFp8Block ? hidden - begin : kFp8Block;
    const float scale = LoadUnalignedFloat(wire + hidden + 4 * (begin / kFp8Block));
    float v[kFp8PerLane];
#pragma unroll
    for (int i = 0; i < kFp8PerLane; ++i) {
      const uint8_t q = first + i < n ? static_cast<uint8_t>(wire[begin + first + i]) : 0;
      v[i] = __fmul_rn(E4m3fnToFloat(q), scale);
    }
    for (int r = 0; r < rows.n; ++r) {
      char* row = EntryPtr(rows, r);
#pragma unroll
      for (int i = 0; i < kFp8PerLane; ++i) {
        if (first + i < n) StoreFromFloat(row, begin + first + i, v[i], kDtype);
      }
    }
  }
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
// Hopper bulk-copy pipeline: mbarriers and the TMA engine's 1-D global -> shared copies.

__device__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ void BarrierInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" : : "r"(SharedAddress(bar)), "r"(count));
}

__device__ void BarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" : : "r"(SharedAddress(bar)) : "memory");
}

__device__ void BarrierExpectBytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :
               : "r"(SharedAddress(bar)), "r"(bytes)
               : "memory");
}

// Waits for the completion of the barrier's phase with parity `parity`.
__device__ void BarrierWait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(SharedAddress(bar)), "r"(parity)
        : "memory");
  }
}

__device__ void BulkLoad(void* smem, const void* global, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      :
      : "r"(SharedAddress(smem)), "l"(global), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}

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

// ----------------------------------------------------------------------------- harness

template <Dtype kDtype>
__device__ void HarnessRank(const ExchangeContext& ctx, int64_t block, const HarnessArgs& a) {
  const int64_t r = ctx.rank, T = ctx.tokens, K = ctx.k, R = ctx.ranks;
  const int64_t rb = ctx.row_bytes;
  const int32_t* dest = a.dest + r * T * K;
  int32_t* recv_row_pos = a.recv_row_pos + r * R * T * K;
  switch (a.exchange) {
    case HarnessExchange::kDispatch:
      SendTokensPhase(ctx, block, a.in_rows + r * T * rb, dest, a.row_pos + r * T * K,
                      a.in_values + r * T * K);
      ReceiveRowsPhase(ctx, block, a.out_rows + r * a.rows * rb, a.out_values + r * a.rows,
                       recv_row_pos, CopyRowsTo(ctx, a.out_rows + r * a.rows * rb));
      break;
    case HarnessExchange::kRedispatch:
      SendTokensPhase(ctx, block, a.in_rows + r * T * rb, dest, nullptr, nullptr);
      ReceiveRedispatchPhase<kDtype>(
          ctx, block, recv_row_pos, a.in_values == nullptr ? nullptr : a.in_values + r * a.rows,
          a.out_rows + r * a.rows * rb,
          a.out_scaled == nullptr ? nullptr : a.out_scaled + r * a.rows * rb);
      break;
    case HarnessExchange::kCombine:
      SendPartialsPhase<kDtype>(ctx, block, a.in_rows + r * a.rows * rb,
                                a.in_values == nullptr ? nullptr : a.in_values + r * a.rows,
                                recv_row_pos);
      ReducePartialsPhase<kDtype>(ctx, block, dest, a.out_rows + r * T * rb);
      break;
    case HarnessExchange::kRowValues:
      SendRowValuesPhase(ctx, block, a.in_values + r * a.rows, recv_row_pos);
      ReceiveRowValuesPhase(ctx, block, dest, a.out_values + r * T * K);
      break;
  }
}

template <Dtype kDtype>
__global__ void __launch_bounds__(kThreads)
    HarnessKernel(const ExchangeContext* contexts, int32_t blocks_per_rank, HarnessArgs args) {
  const ExchangeContext ctx = contexts[blockIdx.x / blocks_per_rank];
  HarnessRank<kDtype>(ctx, blockIdx.x % blocks_per_rank, args);
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

template <typename Launch>
cudaError_t ByDtype(Dtype dtype, Launch&& launch) {
  switch (dtype) {
    case Dtype::kF32:
      launch(std::integral_constant<Dtype, Dtype::kF32>());
      break;
    case Dtype::kBF16:
      launch(std::integral_constant<Dtype, Dtype::kBF16>());
      break;
    case Dtype::kF16:
      launch(std::integral_constant<Dtype, Dtype::kF16>());
      break;
  }
  return cudaGetLastError();
}

}  // namespace

namespace {
struct WindowOffsets {
  size_t payload[2], row_pos[2], values[2], arrived, error_claim, total;
};

WindowOffsets Offsets(const WindowGeometry& g) {
  const size_t slots = static_cast<size_t>(g.ranks * g.tokens);
  const size_t payload = AlignUp(slots * RowStride(g.row_bytes));
  const size_t meta = AlignUp(slots * g.k * sizeof(int32_t));
  WindowOffsets o{};
  size_t at = 0;
  for (int p = 0; p < 2; ++p) {
    o.payload[p] = at;
    at += payload;
    o.row_pos[p] = at;
    at += meta;
    o.values[p] = at;
    at += meta;
  }
  o.arrived = at;
  at += AlignUp(static_cast<size_t>(g.ranks * kMaxSendBlocks) * sizeof(uint64_t));
  o.error_claim = at;
  at += kAlign;
  o.total = at;
  return o;
}
}  // namespace

size_t WindowBytes(const WindowGeometry& geometry) { return Offsets(geometry).total; }

Window CarveWindow(char* base, const WindowGeometry& geometry) {
  const WindowOffsets o = Offsets(geometry);
  Window w;
  for (int p = 0; p < 2; ++p) {
    w.payload[p] = base + o.payload[p];
    w.row_pos[p] = reinterpret_cast<int32_t*>(base + o.row_pos[p]);
    w.values[p] = reinterpret_cast<float*>(base + o.values[p]);
  }
  w.arrived = reinterpret_cast<uint64_t*>(base + o.arrived);
  w.error_claim = reinterpret_cast<uint32_t*>(base + o.error_claim);
  return w;
}

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

cudaError_t HarnessResidentBlocks(int64_t ranks, int* blocks_per_rank) {
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t s = cudaGetDevice(&device);
  if (s == cudaSuccess) s = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  // The float32 instance stands for all: every instance has the same block shape and ring.
  if (s == cudaSuccess) {
    s = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, HarnessKernel<Dtype::kF32>, kThreads,
                                                      kRingBytes);
  }
  if (s != cudaSuccess) return s;
  *blocks_per_rank = static_cast<int>(std::min<int64_t>(
      kMaxSendBlocks, static_cast<int64_t>(sms) * per_sm / std::max<int64_t>(ranks, 1)));
  return cudaSuccess;
}

cudaError_t LaunchHarness(const ExchangeContext* contexts_device, int64_t ranks,
                          int32_t blocks_per_rank, const HarnessArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ranks * blocks_per_rank));
  HarnessArgs a = args;
  const ExchangeContext* contexts = contexts_device;
  int32_t bpr = blocks_per_rank;
  void* params[] = {&contexts, &bpr, &a};
  cudaError_t status = cudaSuccess;
  ByDtype(args.dtype, [&](auto d) {
    status = cudaLaunchCooperativeKernel(
        reinterpret_cast<const void*>(&HarnessKernel<decltype(d)::value>), grid, dim3(kThreads),
        params, kRingBytes, stream);
  });
  return status != cudaSuccess ? status : cudaGetLastError();
}

}  // namespace jax_hybridep
