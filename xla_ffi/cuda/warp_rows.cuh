// Warp-level row operations of the transport kernels: a token's K routing entries held in the
// lanes of a warp (WarpList), and rows copied, scaled, summed, quantised or dequantised by the
// lanes of one warp. Results are bitwise those of the host steps (exchange.h, fp8.h): sums use
// __fadd_rn / __fmul_rn in the host's order and 16-bit values go through numeric.h's conversions.
// Device code is compiled into every .cu file that includes it (whole-program CUDA, no device
// linking), so it has internal linkage here.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_WARP_ROWS_CUH_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_WARP_ROWS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "xla_ffi/fp8.h"
#include "xla_ffi/numeric.h"

namespace jax_hybridep {
namespace {

// The row kernels work a warp per token (or item): the lanes read the token's K routing entries
// once into registers and pass row addresses by shuffles, and the copy loops keep several 16-byte
// loads per lane in flight before their stores. (Block-wide loops that re-read the row list from
// memory for every word ran at 4 GB/s of dispatch payload per SM on an H200; docs/benchmarks.md.)
constexpr unsigned kAllLanes = 0xffffffffu;
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

}  // namespace
}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_WARP_ROWS_CUH_
