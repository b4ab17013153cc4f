// CUDA exchange kernels: the device twins of ExpandRows, WritePartials, ReducePartials and
// WriteRowValues (exchange.cc), bitwise identical to them (docs/design.md §2.1.4).
//
// These are the per-rank steps of the direct-write transport; peers are reached through arrays of
// device pointers (peer memory over NVLink, or plain buffers of one GPU in the self-tests). Sums
// use __fadd_rn / __fmul_rn in the host's order, so neither FMA contraction nor reassociation can
// change a bit whatever the compiler flags; 16-bit values go through numeric.h's conversions.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "xla_ffi/cuda/kernels.h"

namespace jax_hybridep {
namespace {

constexpr int kRowThreads = 256;
// Blocks walk slots (or tokens) with a grid stride; this many keep every SM busy without paying
// for a launch of one block per slot when T * R is large.
constexpr int64_t kMaxRowBlocks = 4096;

dim3 RowGrid(int64_t items) { return dim3(static_cast<unsigned>(std::min(items, kMaxRowBlocks))); }

// Copies each received token into all of its rows, `Word` bytes at a time: each word is read once
// and written to every row of the token.
template <typename Word>
__global__ void ExpandRowsKernel(ExchangeShape shape, DispatchRecvBuffer recv, char* out_tokens,
                                 float* out_weights) {
  const int64_t slots = shape.ranks * shape.tokens;
  const int64_t words = shape.row_bytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t slot = blockIdx.x; slot < slots; slot += gridDim.x) {
    if (recv.token_ids[slot] < 0) continue;
    const int32_t* row_pos = recv.row_pos + slot * shape.k;
    const Word* src = reinterpret_cast<const Word*>(recv.tokens + slot * shape.row_bytes);
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) {
      const Word value = src[w];
      for (int64_t j = 0; j < shape.k; ++j) {
        const int32_t row = row_pos[j];
        if (row >= 0) reinterpret_cast<Word*>(out_tokens + row * shape.row_bytes)[w] = value;
      }
    }
    for (int64_t j = threadIdx.x; j < shape.k; j += blockDim.x) {
      if (row_pos[j] >= 0) out_weights[row_pos[j]] = recv.weights[slot * shape.k + j];
    }
  }
}

template <Dtype kDtype>
__global__ void WritePartialsKernel(ExchangeShape shape, int64_t rank, const char* y,
                                    const float* weights, const int32_t* token_ids,
                                    const int32_t* recv_row_pos, char* const* peer_partials) {
  const int64_t T = shape.tokens, K = shape.k;
  const int64_t hidden = shape.row_bytes / DtypeBytes(kDtype);
  for (int64_t slot = blockIdx.x; slot < shape.ranks * T; slot += gridDim.x) {
    const int32_t t = token_ids[slot];
    if (t < 0) continue;
    const int32_t* row_pos = recv_row_pos + slot * K;
    char* out = peer_partials[slot / T] + (rank * T + t) * shape.row_bytes;
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      float acc = 0.0f;  // Not the first term: the host starts from +0, which turns -0 into +0.
      for (int64_t kk = 0; kk < K; ++kk) {
        const int32_t row = row_pos[kk];
        if (row < 0) continue;
        float v = LoadAsFloat(y, row * hidden + h, kDtype);
        if (weights != nullptr) v = __fmul_rn(v, weights[row]);
        acc = __fadd_rn(acc, v);
      }
      StoreFromFloat(out, h, acc, kDtype);
    }
  }
}

// One token per block iteration. Thread 0 lists the token's distinct destinations in ascending
// order (K is small) in shared memory, then all threads sum those partials column by column.
template <Dtype kDtype>
__global__ void ReducePartialsKernel(ExchangeShape shape, const char* partials, const int32_t* dest,
                                     char* out) {
  extern __shared__ int32_t dests[];  // [K]
  __shared__ int64_t num_dests;
  const int64_t T = shape.tokens, K = shape.k;
  const int64_t hidden = shape.row_bytes / DtypeBytes(kDtype);
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    if (threadIdx.x == 0) {
      int64_t n = 0;
      for (int64_t i = 0; i < K; ++i) {
        const int32_t d = dest[t * K + i];
        bool seen = d < 0;
        for (int64_t j = 0; j < n && !seen; ++j) seen = dests[j] == d;
        if (seen) continue;
        int64_t j = n++;  // Insertion sort keeps the list ascending.
        for (; j > 0 && dests[j - 1] > d; --j) dests[j] = dests[j - 1];
        dests[j] = d;
      }
      num_dests = n;
    }
    __syncthreads();
    char* out_row = out + t * shape.row_bytes;
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      float acc = 0.0f;
      for (int64_t i = 0; i < num_dests; ++i) {
        const char* partial = partials + (dests[i] * T + t) * shape.row_bytes;
        acc = __fadd_rn(acc, LoadAsFloat(partial, h, kDtype));
      }
      StoreFromFloat(out_row, h, acc, kDtype);
    }
    __syncthreads();  // The list is rewritten for the next token.
  }
}

__global__ void WriteRowValuesKernel(ExchangeShape shape, const float* values,
                                     const int32_t* token_ids, const int32_t* recv_row_pos,
                                     float* const* peer_out) {
  const int64_t T = shape.tokens, K = shape.k;
  for (int64_t slot = blockIdx.x; slot < shape.ranks * T; slot += gridDim.x) {
    const int32_t t = token_ids[slot];
    if (t < 0) continue;
    float* out = peer_out[slot / T] + t * K;
    for (int64_t kk = threadIdx.x; kk < K; kk += blockDim.x) {
      const int32_t row = recv_row_pos[slot * K + kk];
      if (row >= 0) out[kk] = values[row];
    }
  }
}

template <typename Word>
void LaunchExpand(const ExchangeShape& shape, const DispatchRecvBuffer& recv, char* out_tokens,
                  float* out_weights, cudaStream_t stream) {
  ExpandRowsKernel<Word><<<RowGrid(shape.ranks * shape.tokens), kRowThreads, 0, stream>>>(
      shape, recv, out_tokens, out_weights);
}

}  // namespace

cudaError_t LaunchExpandRows(const ExchangeShape& shape, const DispatchRecvBuffer& recv,
                             char* out_tokens, float* out_weights, cudaStream_t stream) {
  // Zero everything first, then copy: a row a token fills is written twice, which is simpler than
  // finding the untouched rows and costs one extra pass over C rows.
  cudaError_t status = cudaMemsetAsync(out_tokens, 0, shape.rows * shape.row_bytes, stream);
  if (status != cudaSuccess) return status;
  status = cudaMemsetAsync(out_weights, 0, shape.rows * sizeof(float), stream);
  if (status != cudaSuccess || shape.ranks * shape.tokens == 0) return status;
  switch (WordBytes(recv.tokens, out_tokens, shape.row_bytes)) {
    case 16:
      LaunchExpand<uint4>(shape, recv, out_tokens, out_weights, stream);
      break;
    case 8:
      LaunchExpand<uint2>(shape, recv, out_tokens, out_weights, stream);
      break;
    case 4:
      LaunchExpand<uint32_t>(shape, recv, out_tokens, out_weights, stream);
      break;
    case 2:
      LaunchExpand<uint16_t>(shape, recv, out_tokens, out_weights, stream);
      break;
    default:
      LaunchExpand<uint8_t>(shape, recv, out_tokens, out_weights, stream);
      break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchWritePartials(const ExchangeShape& shape, int64_t rank, Dtype dtype,
                                const char* y, const float* weights, const int32_t* token_ids,
                                const int32_t* recv_row_pos, char* const* peer_partials,
                                cudaStream_t stream) {
  const int64_t slots = shape.ranks * shape.tokens;
  if (slots == 0) return cudaSuccess;
  const dim3 grid = RowGrid(slots);
  switch (dtype) {
    case Dtype::kF32:
      WritePartialsKernel<Dtype::kF32><<<grid, kRowThreads, 0, stream>>>(
          shape, rank, y, weights, token_ids, recv_row_pos, peer_partials);
      break;
    case Dtype::kBF16:
      WritePartialsKernel<Dtype::kBF16><<<grid, kRowThreads, 0, stream>>>(
          shape, rank, y, weights, token_ids, recv_row_pos, peer_partials);
      break;
    case Dtype::kF16:
      WritePartialsKernel<Dtype::kF16><<<grid, kRowThreads, 0, stream>>>(
          shape, rank, y, weights, token_ids, recv_row_pos, peer_partials);
      break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchReducePartials(const ExchangeShape& shape, Dtype dtype, const char* partials,
                                 const int32_t* dest, char* out, cudaStream_t stream) {
  if (shape.tokens == 0) return cudaSuccess;
  const dim3 grid = RowGrid(shape.tokens);
  const size_t shared_bytes = std::max<int64_t>(shape.k, 1) * sizeof(int32_t);
  switch (dtype) {
    case Dtype::kF32:
      ReducePartialsKernel<Dtype::kF32>
          <<<grid, kRowThreads, shared_bytes, stream>>>(shape, partials, dest, out);
      break;
    case Dtype::kBF16:
      ReducePartialsKernel<Dtype::kBF16>
          <<<grid, kRowThreads, shared_bytes, stream>>>(shape, partials, dest, out);
      break;
    case Dtype::kF16:
      ReducePartialsKernel<Dtype::kF16>
          <<<grid, kRowThreads, shared_bytes, stream>>>(shape, partials, dest, out);
      break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchWriteRowValues(const ExchangeShape& shape, const float* values,
                                 const int32_t* token_ids, const int32_t* recv_row_pos,
                                 float* const* peer_out, cudaStream_t stream) {
  const int64_t slots = shape.ranks * shape.tokens;
  if (slots == 0) return cudaSuccess;
  // One warp per slot: it has only K values to move.
  WriteRowValuesKernel<<<RowGrid(slots), 32, 0, stream>>>(shape, values, token_ids, recv_row_pos,
                                                          peer_out);
  return cudaGetLastError();
}

}  // namespace jax_hybridep
