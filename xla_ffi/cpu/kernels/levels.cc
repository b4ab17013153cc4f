#include "xla_ffi/cpu/kernels/levels.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "xla_ffi/cpu/kernels/exchange.h"

namespace jax_hybridep {

void ClearItems(const LevelShape& shape, int64_t count, const LevelItems& items) {
  // Empty slots' payload is never read (every reader skips slots whose metadata is empty), so
  // only the metadata is cleared, not the [count, row_bytes] payload.
  std::fill(items.dest, items.dest + count * shape.k, -1);
  std::fill(items.pos, items.pos + count * shape.k, -1);
  std::fill(items.weights, items.weights + count * shape.k, 0.0f);
}

void SendLevel(const LevelShape& shape, const LevelItems& held, const LevelItems* const* out,
               const int64_t* base, int32_t* send_slot) {
  const int64_t S = shape.size, K = shape.k;
  std::vector<int64_t> next(S, 0);
  std::vector<int64_t> peer_of(K);
  for (int64_t m = 0; m < shape.items; ++m) {
    for (int64_t j = 0; j < K; ++j) {
      const int32_t d = held.dest[m * K + j];
      peer_of[j] = d >= 0 ? (d / shape.stride) % S : -1;
    }
    for (int64_t p = 0; p < S; ++p) {
      send_slot[m * S + p] = -1;
      if (std::find(peer_of.begin(), peer_of.end(), p) == peer_of.end()) continue;
      const int64_t j_slot = next[p]++;
      send_slot[m * S + p] = static_cast<int32_t>(j_slot);
      const LevelItems& dst = *out[p];
      const int64_t slot = base[p] + j_slot;
      std::memcpy(dst.rows + slot * shape.row_bytes, held.rows + m * shape.row_bytes,
                  shape.row_bytes);
      for (int64_t j = 0; j < K; ++j) {
        const bool here = peer_of[j] == p;
        dst.dest[slot * K + j] = here ? held.dest[m * K + j] : -1;
        dst.pos[slot * K + j] = here ? held.pos[m * K + j] : -1;
        dst.weights[slot * K + j] = here ? held.weights[m * K + j] : 0.0f;
      }
    }
  }
}

void ExpandItems(const LevelShape& shape, const LevelItems& items, int64_t rows, Dtype dtype,
                 const RowOutputs& out) {
  std::vector<RowSource> sources;
  for (int64_t i = 0; i < shape.items * shape.k; ++i) {
    if (items.pos[i] < 0) continue;
    sources.push_back({items.pos[i], items.rows + (i / shape.k) * shape.row_bytes,
                       items.weights != nullptr ? items.weights[i] : 0.0f});
  }
  WriteRows(rows, OutputRowBytes(out, shape.row_bytes, dtype), dtype, sources, out);
}

void ItemPartials(int64_t items, int64_t k, int64_t row_bytes, Dtype dtype, const char* y,
                  const float* weights, const int32_t* pos, char* partials) {
  RowSum acc(row_bytes / DtypeBytes(dtype), dtype);
  for (int64_t m = 0; m < items; ++m) {
    if (m + 1 < items) {  // the next item's rows are scattered over y: fetch them early
      for (const int32_t* next = pos + (m + 1) * k; next < pos + (m + 2) * k; ++next) {
        if (*next >= 0) PrefetchRow(y + *next * row_bytes, row_bytes);
      }
    }
    acc.Clear();  // an empty slot stores +0
    for (int64_t j = 0; j < k; ++j) {
      const int32_t row = pos[m * k + j];
      if (row < 0) continue;
      acc.Add(y + row * row_bytes, weights != nullptr, weights != nullptr ? weights[row] : 1.0f);
    }
    acc.Store(partials + m * row_bytes);
  }
}

void ReduceLevel(const LevelShape& shape, Dtype dtype, const char* const* back,
                 const int32_t* send_slot, char* out) {
  const int64_t S = shape.size, M = shape.items, rb = shape.row_bytes;
  RowSum acc(rb / DtypeBytes(dtype), dtype);
  for (int64_t m = 0; m < M; ++m) {
    if (m + 1 < M) {  // the next item's partials, one per peer block
      for (int64_t p = 0; p < S; ++p) {
        const int32_t slot = send_slot[(m + 1) * S + p];
        if (slot >= 0) PrefetchRow(back[p] + slot * rb, rb);
      }
    }
    acc.Clear();
    for (int64_t p = 0; p < S; ++p) {
      const int32_t slot = send_slot[m * S + p];
      if (slot >= 0) acc.Add(back[p] + slot * rb);
    }
    acc.Store(out + m * rb);
  }
}

void PickLevelValues(const LevelShape& shape, const float* back, const int32_t* send_slot,
                     const int32_t* held_dest, float* out) {
  const int64_t S = shape.size, M = shape.items, K = shape.k;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < K; ++j) {
      const int32_t d = held_dest[m * K + j];
      out[m * K + j] = 0.0f;
      if (d < 0) continue;
      const int64_t p = (d / shape.stride) % S;
      const int32_t slot = send_slot[m * S + p];
      if (slot >= 0) out[m * K + j] = back[(p * M + slot) * K + j];
    }
  }
}

void WriteBlocks(int64_t size, int64_t block_bytes, int64_t coord, const char* src,
                 char* const* peer_dst) {
  for (int64_t p = 0; p < size; ++p) {
    std::memcpy(peer_dst[p] + coord * block_bytes, src + p * block_bytes, block_bytes);
  }
}

}  // namespace jax_hybridep
