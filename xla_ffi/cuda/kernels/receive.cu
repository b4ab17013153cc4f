// The transport's wide kernels (transport.h), run on every SM once this rank's transport blocks
// are done: the permute of the dense receive buffer into expert-major rows (dispatch, redispatch),
// the local unpermute of combine (each received item's rows summed in ascending k), and the
// reduce of the partials that came back. A warp takes a slot (or item) at a time; lanes move 16
// bytes per access (one STG.128 per lane and row), and rows nobody fills are the only ones
// zeroed. Sums are __fadd_rn / __fmul_rn in the reference's order
// (lab/native/cuda/reference.cc), 16-bit values go through numeric.h's conversions, FP8 wire rows
// through fp8.h's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "xla_ffi/common/fp8.h"
#include "xla_ffi/cuda/device/launch.h"
#include "xla_ffi/cuda/device/sync.cuh"
#include "xla_ffi/cuda/device/warp.cuh"
#include "xla_ffi/cuda/kernels/transport.h"

namespace jax_hybridep {
namespace {
using namespace device;  // NOLINT: the kernels' device helpers

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
// Element groups (16 bytes each) a lane loads before it stores or adds them.
constexpr int kInFlight = 4;

// Elements of kDtype in 16 bytes; 1 where rows are not whole aligned 16-byte words.
template <Dtype kDtype, bool kWide>
constexpr int kGroup = !kWide ? 1 : (kDtype == Dtype::kF32 ? 4 : 8);

// kN consecutive elements of a row as float32, and back (one 16-byte access when kN > 1).
template <Dtype kDtype, int kN>
__device__ __forceinline__ void LoadGroup(const char* row, int64_t e, float (&v)[kN]) {
  if constexpr (kN == 1) {
    v[0] = LoadAsFloat(row, e, kDtype);
  } else {
    const uint4 word = *reinterpret_cast<const uint4*>(row + e * DtypeBytes(kDtype));
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = LoadAsFloat(&word, i, kDtype);
  }
}

template <Dtype kDtype, int kN>
__device__ __forceinline__ void StoreGroup(char* row, int64_t e, const float (&v)[kN]) {
  if constexpr (kN == 1) {
    StoreFromFloat(row, e, v[0], kDtype);
  } else {
    uint4 word;
#pragma unroll
    for (int i = 0; i < kN; ++i) StoreFromFloat(&word, i, v[i], kDtype);
    *reinterpret_cast<uint4*>(row + e * DtypeBytes(kDtype)) = word;
  }
}

// A slot's (or item's) K entries held by the warp: entry k in lane k % 32 of half k / 32, and the
// kept ones as bit masks every lane has.
struct Entries {
  int32_t value[2];
  uint32_t kept[2];
};

__device__ __forceinline__ Entries LoadEntries(const int32_t* entries, int64_t k) {
  Entries e;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t i = Lane() + 32 * h;
    e.value[h] = i < k ? entries[i] : -1;
    e.kept[h] = __ballot_sync(kAllLanes, e.value[h] >= 0);
  }
  return e;
}

// Calls f(value) for the kept entries in ascending k (every lane, the same values).
template <typename F>
__device__ __forceinline__ void ForKept(const Entries& e, F&& f) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    for (uint32_t m = e.kept[h]; m != 0; m &= m - 1)
      f(__shfl_sync(kAllLanes, e.value[h], __ffs(m) - 1));
  }
}

struct PermuteArgs {
  ExchangeParams ex;
  char* own;                 // this rank's window
  int64_t k;                 // K
  const int32_t* recv_rows;  // [>= n, K]
  const int32_t* row_slot;   // [C]
  const int32_t* info;       // [2]
  PaddingFill fill;
  char* out;  // [C, out_row_bytes]
  int64_t out_row_bytes;
  int64_t hidden;      // elements of a row
  const float* scale;  // [C] (kScaled)
  char* out_scaled;    // [C, out_row_bytes] (kScaled)
};

// kN elements of an FP8 wire row of `hidden` elements (fp8.h) from element e, dequantised:
// float32(q) * the block's scale. kN > 1: one access for the kN payload bytes (e a multiple of
// kN, hidden a multiple of 8, so the scales are 4-byte aligned too). The window is written by
// peers while this kernel runs: plain loads, never the read-only path.
template <int kN>
__device__ __forceinline__ void DequantizeGroup(const char* wire, int64_t hidden, int64_t e,
                                                float (&v)[kN]) {
  float scale;
  uint8_t q[kN];
  if constexpr (kN > 1) {
    scale = *reinterpret_cast<const float*>(wire + hidden + 4 * (e / kFp8Block));
    using Word = std::conditional_t<kN == 8, uint2, uint32_t>;
    const Word word = *reinterpret_cast<const Word*>(wire + e);
#pragma unroll
    for (int i = 0; i < kN; ++i) q[i] = reinterpret_cast<const uint8_t*>(&word)[i];
  } else {
    uint32_t bits = 0;
    const char* at = wire + hidden + 4 * (e / kFp8Block);
#pragma unroll
    for (int b = 0; b < 4; ++b)
      bits |= static_cast<uint32_t>(static_cast<uint8_t>(at[b])) << (8 * b);
    scale = __uint_as_float(bits);
    q[0] = static_cast<uint8_t>(wire[e]);
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) v[i] = __fmul_rn(E4m3fnToFloat(q[i]), scale);
}

// The permute's copy of one slot into its rows: kDtype rows, or (kFp8) a wire row dequantised.
// kWide: 16-byte words (rows of whole aligned words; FP8: hidden a multiple of 8).
template <Dtype kDtype, bool kFp8, bool kScaled, bool kWide>
__device__ void PermuteSlot(const PermuteArgs& a, const char* payload, const Entries& rows) {
  constexpr int kN = kGroup<kDtype, kWide>;
  for (int64_t base = 0; base < a.hidden; base += 32 * kN * kInFlight) {
    float v[kInFlight][kN];
#pragma unroll
    for (int b = 0; b < kInFlight; ++b) {
      const int64_t e = base + (Lane() + 32 * b) * kN;
      if (e >= a.hidden) continue;
      if constexpr (kFp8) {
        DequantizeGroup<kN>(payload, a.hidden, e, v[b]);
      } else {
        LoadGroup<kDtype, kN>(payload, e, v[b]);
      }
    }
    // The kept rows in ascending k, written out (no lambda: the groups must stay in registers).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      for (uint32_t m = rows.kept[h]; m != 0; m &= m - 1) {
        const int32_t r = __shfl_sync(kAllLanes, rows.value[h], __ffs(m) - 1);
        const float s = kScaled ? a.scale[r] : 0.0f;
#pragma unroll
        for (int b = 0; b < kInFlight; ++b) {
          const int64_t e = base + (Lane() + 32 * b) * kN;
          if (e >= a.hidden) continue;
          StoreGroup<kDtype, kN>(a.out + r * a.out_row_bytes, e, v[b]);
          if constexpr (kScaled) {
            float w[kN];
#pragma unroll
            for (int i = 0; i < kN; ++i) w[i] = __fmul_rn(v[b][i], s);
            StoreGroup<kDtype, kN>(a.out_scaled + r * a.out_row_bytes, e, w);
          }
        }
      }
    }
  }
}

// Plain byte copy of a slot into its rows: 16-byte words (kWide) or bytes.
template <bool kWide>
__device__ void CopySlot(const PermuteArgs& a, const char* payload, const Entries& rows) {
  using Word = std::conditional_t<kWide, uint4, uint8_t>;
  const int64_t words = a.ex.row_bytes / static_cast<int64_t>(sizeof(Word));
  const Word* from = reinterpret_cast<const Word*>(payload);
  for (int64_t base = 0; base < words; base += 32 * kInFlight) {
    Word v[kInFlight];
#pragma unroll
    for (int b = 0; b < kInFlight; ++b) {
      const int64_t w = base + Lane() + 32 * b;
      if (w < words) v[b] = from[w];
    }
    ForKept(rows, [&](int32_t r) {
      Word* to = reinterpret_cast<Word*>(a.out + r * a.out_row_bytes);
#pragma unroll
      for (int b = 0; b < kInFlight; ++b) {
        const int64_t w = base + Lane() + 32 * b;
        if (w < words) to[w] = v[b];
      }
    });
  }
}

// Rows nobody fills, below the zero line: zero, and with kScaled 0 * scale in the scaled rows;
// a warp per row (no index division), its lanes over 16-byte words (kWide) or bytes, elements
// for the scaled rows.
template <Dtype kDtype, bool kScaled, bool kWide>
__device__ void ZeroPadding(const PermuteArgs& a) {
  // 32-bit: rows and pad multiples are int32 (a 64-bit division would be a subroutine call,
  // around which live registers go to the stack).
  const int32_t pad = static_cast<int32_t>(a.fill.pad_multiple), last = a.info[1];
  const int64_t line = pad == 0 ? a.fill.rows : static_cast<int64_t>((last + pad - 1) / pad) * pad;
  const int64_t end = line < a.fill.rows ? line : a.fill.rows;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; r < end;
       r += warps) {
    if (a.row_slot[r] >= 0) continue;
    char* row = a.out + r * a.out_row_bytes;
    if constexpr (!kScaled) {
      using Word = std::conditional_t<kWide, uint4, uint8_t>;
      const int64_t words = a.out_row_bytes / static_cast<int64_t>(sizeof(Word));
      for (int64_t w = Lane(); w < words; w += 32) reinterpret_cast<Word*>(row)[w] = {};
    } else {
      constexpr int kN = kGroup<kDtype, kWide>;
      const float s = __fmul_rn(0.0f, a.scale[r]);
      float zero[kN], scaled[kN];
#pragma unroll
      for (int n = 0; n < kN; ++n) zero[n] = 0.0f, scaled[n] = s;
      for (int64_t e = Lane() * kN; e < a.hidden; e += 32 * kN) {
        StoreGroup<kDtype, kN>(row, e, zero);
        StoreGroup<kDtype, kN>(a.out_scaled + r * a.out_row_bytes, e, scaled);
      }
    }
  }
}

// kCopy: rows moved as bytes (any row, FP8 wire rows included); otherwise elements of kDtype
// (dequantised from FP8 wire rows with kFp8, scaled besides with kScaled).
template <bool kCopy, Dtype kDtype, bool kFp8, bool kScaled, bool kWide>
__global__ void __launch_bounds__(kThreads) PermuteKernel(const PermuteArgs a) {
  const uint64_t generation = Generation(a.own, a.ex);
  if (BlockWaitAll(a.own, a.ex, generation)) {
    const char* slots = Payload(a.own, a.ex, generation);
    const int64_t n = a.info[0];
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    for (int64_t j = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; j < n;
         j += warps) {
      const Entries rows = LoadEntries(a.recv_rows + j * a.k, a.k);
      const char* payload = slots + j * a.ex.window.slot_stride;
      if constexpr (kCopy) {
        CopySlot<kWide>(a, payload, rows);
      } else {
        PermuteSlot<kDtype, kFp8, kScaled, kWide>(a, payload, rows);
      }
    }
    ZeroPadding<kDtype, kScaled, kWide>(a);
  }
  FinishExchange(a.own, a.ex);
}

// ---------------------------------------------------------------------------- combine

template <Dtype kDtype, bool kWide, bool kWeighted>
__global__ void __launch_bounds__(kThreads)
    UnpermuteKernel(int64_t hidden, int64_t k, const char* y, const float* weights,
                    const int32_t* recv_rows, const int32_t* info, char* partials) {
  constexpr int kN = kGroup<kDtype, kWide>;
  const int64_t row_bytes = hidden * DtypeBytes(kDtype);
  const int64_t n = info[0];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; j < n;
       j += warps) {
    const Entries rows = LoadEntries(recv_rows + j * k, k);
    for (int64_t base = 0; base < hidden; base += 32 * kN * kInFlight) {
      float acc[kInFlight][kN] = {};  // +0, as the CPU kernels start
      ForKept(rows, [&](int32_t r) {
        const float w = kWeighted ? weights[r] : 1.0f;
        float v[kInFlight][kN];
#pragma unroll
        for (int b = 0; b < kInFlight; ++b) {
          const int64_t e = base + (Lane() + 32 * b) * kN;
          if (e < hidden) LoadGroup<kDtype, kN>(y + r * row_bytes, e, v[b]);
        }
#pragma unroll
        for (int b = 0; b < kInFlight; ++b) {
#pragma unroll
          for (int i = 0; i < kN; ++i) {
            acc[b][i] = __fadd_rn(acc[b][i], kWeighted ? __fmul_rn(v[b][i], w) : v[b][i]);
          }
        }
      });
#pragma unroll
      for (int b = 0; b < kInFlight; ++b) {
        const int64_t e = base + (Lane() + 32 * b) * kN;
        if (e < hidden) StoreGroup<kDtype, kN>(partials + j * row_bytes, e, acc[b]);
      }
    }
  }
}

constexpr int kRankWords = kMaxWindowRanks / 32;

struct ReduceArgs {
  ExchangeParams ex;
  char* own;
  int64_t k;
  const int32_t* dest;  // [M, K]
  char* out;            // [M, hidden]
  int64_t hidden;
};

template <Dtype kDtype, bool kWide>
__global__ void __launch_bounds__(kThreads) ReduceKernel(const ReduceArgs a) {
  constexpr int kN = kGroup<kDtype, kWide>;
  const uint64_t generation = Generation(a.own, a.ex);
  if (BlockWaitAll(a.own, a.ex, generation)) {
    const char* partials = Payload(a.own, a.ex, generation);
    const int64_t M = a.ex.items, row_bytes = a.hidden * DtypeBytes(kDtype);
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    for (int64_t m = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; m < M;
         m += warps) {
      const Entries d = LoadEntries(a.dest + m * a.k, a.k);
      uint32_t ranks[kRankWords];  // the distinct destinations as bits, ascending
#pragma unroll
      for (int w = 0; w < kRankWords; ++w) {
        uint32_t bits = 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int32_t r = d.value[h];
          bits |= r >= 0 && r < a.ex.ranks && r / 32 == w ? 1u << (r % 32) : 0u;
        }
        ranks[w] = WarpOr(bits);
      }
      for (int64_t base = 0; base < a.hidden; base += 32 * kN * kInFlight) {
        float acc[kInFlight][kN] = {};
#pragma unroll
        for (int w = 0; w < kRankWords; ++w) {
          for (uint32_t bits = ranks[w]; bits != 0; bits &= bits - 1) {
            const int64_t src = 32 * w + __ffs(bits) - 1;
            const char* partial = partials + (src * M + m) * a.ex.window.slot_stride;
#pragma unroll
            for (int b = 0; b < kInFlight; ++b) {
              const int64_t e = base + (Lane() + 32 * b) * kN;
              if (e >= a.hidden) continue;
              float v[kN];
              LoadGroup<kDtype, kN>(partial, e, v);
#pragma unroll
              for (int i = 0; i < kN; ++i) acc[b][i] = __fadd_rn(acc[b][i], v[i]);
            }
          }
        }
#pragma unroll
        for (int b = 0; b < kInFlight; ++b) {
          const int64_t e = base + (Lane() + 32 * b) * kN;
          if (e < a.hidden) StoreGroup<kDtype, kN>(a.out + m * row_bytes, e, acc[b]);
        }
      }
    }
  }
  FinishExchange(a.own, a.ex);
}

// ---------------------------------------------------------------------------- launches

// Blocks of a wide kernel: a few per SM of this device.
cudaError_t WideGrid(dim3* grid) {
  int device = 0, sms = 0;
  cudaError_t s = cudaGetDevice(&device);
  if (s == cudaSuccess) s = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  *grid = dim3(static_cast<unsigned>(std::max(1, 4 * sms)));
  return s;
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// This rank's window base as this device addresses it: the exchange's peers carry it.
PermuteArgs MakePermuteArgs(const ExchangeParams& ex, int64_t k, const int32_t* recv_rows,
                            const int32_t* row_slot, const int32_t* info, const PaddingFill& fill,
                            char* out, int64_t out_row_bytes, int64_t hidden) {
  PermuteArgs a{};
  a.ex = ex;
  a.own = ex.own;
  a.k = k;
  a.recv_rows = recv_rows;
  a.row_slot = row_slot;
  a.info = info;
  a.fill = fill;
  a.out = out;
  a.out_row_bytes = out_row_bytes;
  a.hidden = hidden;
  return a;
}

}  // namespace

cudaError_t LaunchPermute(const ExchangeParams& ex, int64_t k, const int32_t* recv_rows,
                          const int32_t* row_slot, const int32_t* info, const PaddingFill& fill,
                          char* out, int64_t out_row_bytes, Dtype fp8_dtype, int64_t fp8_hidden,
                          cudaStream_t stream) {
  if (k < 1 || k > kMaxTopK) return cudaErrorInvalidValue;
  dim3 grid;
  if (cudaError_t s = WideGrid(&grid); s != cudaSuccess) return s;
  const bool fp8 = fp8_hidden > 0;
  PermuteArgs a = MakePermuteArgs(ex, k, recv_rows, row_slot, info, fill, out, out_row_bytes,
                                  fp8 ? fp8_hidden : out_row_bytes);
  if (!fp8) {
    const bool wide = out_row_bytes % 16 == 0 && Aligned(out);
    ByWidth(wide, [&](auto w) {
      LaunchKernel(&PermuteKernel<true, Dtype::kF32, false, false, decltype(w)::value>, grid,
                   dim3(kThreads), 0, stream, a);
    });
    return cudaGetLastError();
  }
  if (out_row_bytes != fp8_hidden * DtypeBytes(fp8_dtype)) return cudaErrorInvalidValue;
  const bool wide = fp8_hidden % 8 == 0 && Aligned(out);
  return ByDtype(fp8_dtype, [&](auto d) {
    ByWidth(wide, [&](auto w) {
      LaunchKernel(&PermuteKernel<false, decltype(d)::value, true, false, decltype(w)::value>, grid,
                   dim3(kThreads), 0, stream, a);
    });
  });
}

cudaError_t LaunchPermuteScaled(const ExchangeParams& ex, int64_t k, Dtype dtype,
                                const int32_t* recv_rows, const int32_t* row_slot,
                                const int32_t* info, const PaddingFill& fill, const float* scale,
                                char* out, char* out_scaled, cudaStream_t stream) {
  if (k < 1 || k > kMaxTopK || ex.row_bytes % DtypeBytes(dtype) != 0) return cudaErrorInvalidValue;
  dim3 grid;
  if (cudaError_t s = WideGrid(&grid); s != cudaSuccess) return s;
  PermuteArgs a = MakePermuteArgs(ex, k, recv_rows, row_slot, info, fill, out, ex.row_bytes,
                                  ex.row_bytes / DtypeBytes(dtype));
  a.scale = scale;
  a.out_scaled = out_scaled;
  const bool wide = ex.row_bytes % 16 == 0 && Aligned(out) && Aligned(out_scaled);
  return ByDtype(dtype, [&](auto d) {
    ByWidth(wide, [&](auto w) {
      LaunchKernel(&PermuteKernel<false, decltype(d)::value, false, true, decltype(w)::value>, grid,
                   dim3(kThreads), 0, stream, a);
    });
  });
}

cudaError_t LaunchUnpermute(Dtype dtype, int64_t hidden, int64_t k, const char* y,
                            const float* weights, const int32_t* recv_rows, const int32_t* info,
                            int64_t slots, char* partials, cudaStream_t stream) {
  if (k < 1 || k > kMaxTopK) return cudaErrorInvalidValue;
  if (slots == 0) return cudaSuccess;
  dim3 grid;
  if (cudaError_t s = WideGrid(&grid); s != cudaSuccess) return s;
  const bool wide = hidden * DtypeBytes(dtype) % 16 == 0 && Aligned(y) && Aligned(partials);
  return ByDtype(dtype, [&](auto d) {
    ByWidth(wide, [&](auto w) {
      if (weights != nullptr) {
        LaunchKernel(&UnpermuteKernel<decltype(d)::value, decltype(w)::value, true>, grid,
                     dim3(kThreads), 0, stream, hidden, k, y, weights, recv_rows, info, partials);
      } else {
        LaunchKernel(&UnpermuteKernel<decltype(d)::value, decltype(w)::value, false>, grid,
                     dim3(kThreads), 0, stream, hidden, k, y, weights, recv_rows, info, partials);
      }
    });
  });
}

cudaError_t LaunchReduce(const ExchangeParams& ex, Dtype dtype, int64_t k, const int32_t* dest,
                         char* out, cudaStream_t stream) {
  if (k < 1 || k > kMaxTopK || ex.row_bytes % DtypeBytes(dtype) != 0) return cudaErrorInvalidValue;
  dim3 grid;
  if (cudaError_t s = WideGrid(&grid); s != cudaSuccess) return s;
  const ReduceArgs a{ex, ex.own, k, dest, out, ex.row_bytes / DtypeBytes(dtype)};
  const bool wide = ex.row_bytes % 16 == 0 && Aligned(out);
  return ByDtype(dtype, [&](auto d) {
    ByWidth(wide, [&](auto w) {
      LaunchKernel(&ReduceKernel<decltype(d)::value, decltype(w)::value>, grid, dim3(kThreads), 0,
                   stream, a);
    });
  });
}

}  // namespace jax_hybridep
