#include "xla_ffi/exchange.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace jax_hybridep {
namespace {

// The distinct destination ranks of token t, ascending. Returns how many were written to `out`.
int64_t DistinctDestinations(const int32_t* dest_row, int64_t k, int32_t* out) {
  int64_t n = 0;
  for (int64_t i = 0; i < k; ++i) {
    int32_t d = dest_row[i];
    if (d >= 0 && std::find(out, out + n, d) == out + n) out[n++] = d;
  }
  std::sort(out, out + n);
  return n;
}

}  // namespace

void ClearRecvMetadata(const ExchangeShape& shape, int32_t* token_ids, int32_t* row_pos) {
  std::fill(token_ids, token_ids + shape.ranks * shape.tokens, -1);
  std::fill(row_pos, row_pos + shape.ranks * shape.tokens * shape.k, -1);
}

void WriteTokens(const ExchangeShape& shape, int64_t rank, const char* x, const int32_t* dest,
                 const int32_t* row_pos, const float* weights, DispatchRecvBuffer* const* peers) {
  const int64_t T = shape.tokens, K = shape.k;
  std::vector<int64_t> next_slot(shape.ranks, 0);
  std::vector<int32_t> dests(K);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t num_dests = DistinctDestinations(dest + t * K, K, dests.data());
    for (int64_t i = 0; i < num_dests; ++i) {
      const int32_t d = dests[i];
      DispatchRecvBuffer& recv = *peers[d];
      const int64_t slot = rank * T + next_slot[d]++;
      std::memcpy(recv.tokens + slot * shape.row_bytes, x + t * shape.row_bytes, shape.row_bytes);
      recv.token_ids[slot] = static_cast<int32_t>(t);
      for (int64_t j = 0; j < K; ++j) {
        const bool here = dest[t * K + j] == d;
        recv.row_pos[slot * K + j] = here ? row_pos[t * K + j] : -1;
        recv.weights[slot * K + j] = here && weights != nullptr ? weights[t * K + j] : 0.0f;
      }
    }
  }
}

void ExpandRows(const ExchangeShape& shape, const DispatchRecvBuffer& recv, char* out_tokens,
                float* out_weights) {
  const int64_t K = shape.k;
  std::memset(out_tokens, 0, shape.rows * shape.row_bytes);
  std::fill(out_weights, out_weights + shape.rows, 0.0f);
  for (int64_t slot = 0; slot < shape.ranks * shape.tokens; ++slot) {
    if (recv.token_ids[slot] < 0) continue;
    for (int64_t j = 0; j < K; ++j) {
      const int32_t row = recv.row_pos[slot * K + j];
      if (row < 0) continue;
      std::memcpy(out_tokens + row * shape.row_bytes, recv.tokens + slot * shape.row_bytes,
                  shape.row_bytes);
      out_weights[row] = recv.weights[slot * K + j];
    }
  }
}

void WritePartials(const ExchangeShape& shape, int64_t rank, Dtype dtype, const char* y,
                   const float* weights, const int32_t* token_ids, const int32_t* recv_row_pos,
                   char* const* peer_partials) {
  const int64_t T = shape.tokens, K = shape.k;
  const int64_t hidden = shape.row_bytes / DtypeBytes(dtype);
  std::vector<float> acc(hidden);
  for (int64_t src = 0; src < shape.ranks; ++src) {
    for (int64_t j = 0; j < T; ++j) {
      const int64_t slot = src * T + j;
      const int32_t t = token_ids[slot];
      if (t < 0) continue;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t kk = 0; kk < K; ++kk) {
        const int32_t row = recv_row_pos[slot * K + kk];
        if (row < 0) continue;
        const float w = weights != nullptr ? weights[row] : 1.0f;
        for (int64_t h = 0; h < hidden; ++h) {
          float v = LoadAsFloat(y, row * hidden + h, dtype);
          if (weights != nullptr) v = v * w;
          acc[h] = acc[h] + v;
        }
      }
      char* out = peer_partials[src] + (rank * T + t) * shape.row_bytes;
      for (int64_t h = 0; h < hidden; ++h) StoreFromFloat(out, h, acc[h], dtype);
    }
  }
}

void ReducePartials(const ExchangeShape& shape, Dtype dtype, const char* partials,
                    const int32_t* dest, char* out) {
  const int64_t T = shape.tokens, K = shape.k;
  const int64_t hidden = shape.row_bytes / DtypeBytes(dtype);
  std::vector<float> acc(hidden);
  std::vector<int32_t> dests(K);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const int64_t num_dests = DistinctDestinations(dest + t * K, K, dests.data());
    for (int64_t i = 0; i < num_dests; ++i) {
      const char* partial = partials + (dests[i] * T + t) * shape.row_bytes;
      for (int64_t h = 0; h < hidden; ++h) acc[h] = acc[h] + LoadAsFloat(partial, h, dtype);
    }
    char* row = out + t * shape.row_bytes;
    for (int64_t h = 0; h < hidden; ++h) StoreFromFloat(row, h, acc[h], dtype);
  }
}

void WriteRowValues(const ExchangeShape& shape, const float* values, const int32_t* token_ids,
                    const int32_t* recv_row_pos, float* const* peer_out) {
  const int64_t T = shape.tokens, K = shape.k;
  for (int64_t src = 0; src < shape.ranks; ++src) {
    for (int64_t j = 0; j < T; ++j) {
      const int64_t slot = src * T + j;
      const int32_t t = token_ids[slot];
      if (t < 0) continue;
      for (int64_t kk = 0; kk < K; ++kk) {
        const int32_t row = recv_row_pos[slot * K + kk];
        if (row >= 0) peer_out[src][t * K + kk] = values[row];
      }
    }
  }
}

}  // namespace jax_hybridep
