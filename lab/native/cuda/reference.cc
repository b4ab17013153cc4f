// References of the transport's slot map and row steps (kernels/slot_map.h, reference.h): the
// specification the CUDA kernels and the numpy twin are checked against, written as plainly as
// the steps allow.
#include "lab/native/cuda/reference.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "xla_ffi/common/fp8.h"
#include "xla_ffi/cuda/kernels/slot_map.h"

namespace jax_hybridep {
namespace {

// (destination, row, weight bits) of (s, m, k) in the gathered routing.
const int32_t* Entry(const SlotMapShape& shape, const int32_t* gathered, int64_t s, int64_t m,
                     int64_t k) {
  return gathered + ((s * shape.items + m) * shape.k + k) * 3;
}

// Whether item m of source s has a row at destination p.
bool GoesTo(const SlotMapShape& shape, const int32_t* gathered, int64_t s, int64_t m, int64_t p) {
  for (int64_t k = 0; k < shape.k; ++k) {
    if (Entry(shape, gathered, s, m, k)[0] == p) return true;
  }
  return false;
}

}  // namespace

void SlotMapReference(const SlotMapShape& shape, int32_t rank, const int32_t* gathered,
                      int32_t* send_slot, int32_t* recv_item, int32_t* recv_rows,
                      float* row_weights, int32_t* row_slot, int32_t* info) {
  const int64_t S = shape.ranks, M = shape.items, K = shape.k, C = shape.rows;
  std::fill_n(send_slot, ChunkPadded(M) * S, -1);
  std::fill_n(recv_item, ChunkPadded(S * M), -1);
  std::fill_n(recv_rows, ChunkPadded(S * M) * K, -1);
  std::fill_n(row_weights, C, 0.0f);
  std::fill_n(row_slot, C, -1);
  // Walking (source, item) in order hands each destination its slots densely.
  std::vector<int64_t> next(S, 0);
  int32_t last = 0;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t p = 0; p < S; ++p) {
        if (!GoesTo(shape, gathered, s, m, p)) continue;
        const int64_t j = next[p]++;
        if (s == rank) send_slot[m * S + p] = static_cast<int32_t>(j);
        if (p != rank) continue;
        recv_item[j] = static_cast<int32_t>(s * M + m);
        for (int64_t k = 0; k < K; ++k) {
          const int32_t* e = Entry(shape, gathered, s, m, k);
          if (e[0] != rank || e[1] < 0 || e[1] >= C) continue;
          recv_rows[j * K + k] = e[1];
          row_weights[e[1]] = BitsToFloat(static_cast<uint32_t>(e[2]));
          row_slot[e[1]] = static_cast<int32_t>(j);
          last = std::max(last, e[1] + 1);
        }
      }
    }
  }
  info[0] = static_cast<int32_t>(next[rank]);
  info[1] = last;
}

void PermuteReference(const SlotMapShape& shape, const char* slots, int64_t slot_stride,
                      int64_t row_bytes, const int32_t* recv_rows, const int32_t* row_slot,
                      const int32_t* info, int64_t zero_pad_multiple, char* out, Dtype dtype,
                      int64_t fp8_hidden, const float* scale, char* out_scaled) {
  const int64_t K = shape.k, C = shape.rows;
  const bool fp8 = fp8_hidden > 0;
  const int64_t hidden = fp8 ? fp8_hidden : row_bytes / DtypeBytes(dtype);
  const int64_t out_row_bytes = fp8 ? fp8_hidden * DtypeBytes(dtype) : row_bytes;
  for (int64_t j = 0; j < info[0]; ++j) {
    const char* payload = slots + j * slot_stride;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t r = recv_rows[j * K + k];
      if (r < 0) continue;
      char* row = out + r * out_row_bytes;
      if (fp8) {
        DequantizeRow(reinterpret_cast<const uint8_t*>(payload), fp8_hidden, dtype, row);
      } else {
        std::memcpy(row, payload, row_bytes);
      }
      if (scale == nullptr) continue;
      for (int64_t h = 0; h < hidden; ++h) {
        StoreFromFloat(out_scaled + r * out_row_bytes, h, LoadAsFloat(row, h, dtype) * scale[r],
                       dtype);
      }
    }
  }
  const int64_t pad = zero_pad_multiple;
  const int64_t zero_end = pad == 0 ? C : std::min<int64_t>(C, (info[1] + pad - 1) / pad * pad);
  for (int64_t r = 0; r < zero_end; ++r) {
    if (row_slot[r] >= 0) continue;
    std::memset(out + r * out_row_bytes, 0, out_row_bytes);
    if (scale == nullptr) continue;
    for (int64_t h = 0; h < hidden; ++h) {
      StoreFromFloat(out_scaled + r * out_row_bytes, h, 0.0f * scale[r], dtype);
    }
  }
}

void UnpermuteReference(const SlotMapShape& shape, Dtype dtype, int64_t hidden, const char* y,
                        const float* weights, const int32_t* recv_rows, const int32_t* info,
                        char* partials) {
  const int64_t K = shape.k, row_bytes = hidden * DtypeBytes(dtype);
  for (int64_t j = 0; j < info[0]; ++j) {
    for (int64_t h = 0; h < hidden; ++h) {
      float acc = 0.0f;  // +0, as the kernels start
      for (int64_t k = 0; k < K; ++k) {
        const int32_t r = recv_rows[j * K + k];
        if (r < 0) continue;
        float v = LoadAsFloat(y + r * row_bytes, h, dtype);
        if (weights != nullptr) v = v * weights[r];
        acc = acc + v;
      }
      StoreFromFloat(partials + j * row_bytes, h, acc, dtype);
    }
  }
}

void ReduceReference(const SlotMapShape& shape, Dtype dtype, int64_t hidden, const char* partials,
                     const int32_t* dest, char* out) {
  const int64_t S = shape.ranks, M = shape.items, K = shape.k;
  const int64_t row_bytes = hidden * DtypeBytes(dtype);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t h = 0; h < hidden; ++h) {
      float acc = 0.0f;
      for (int64_t d = 0; d < S; ++d) {
        bool here = false;
        for (int64_t k = 0; k < K; ++k) here = here || dest[m * K + k] == d;
        if (here) acc = acc + LoadAsFloat(partials + (d * M + m) * row_bytes, h, dtype);
      }
      StoreFromFloat(out + m * row_bytes, h, acc, dtype);
    }
  }
}

}  // namespace jax_hybridep
