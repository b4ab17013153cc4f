#include "xla_ffi/cpu/kernels/exchange.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "xla_ffi/common/fp8.h"
#include "xla_ffi/common/row_kernel.h"

namespace jax_hybridep {
namespace {

// The row kernels (numeric.h's *RowT) by dtype, each compiled for several x86 vector extensions
// and picked at load time; results are the same bits on each. `first`: acc is +0 and is not read.
JAX_HYBRIDEP_ROW_KERNEL void AccumulateRow(float* acc, const void* row, int64_t hidden, Dtype dtype,
                                           bool weighted, float w, bool first) {
  switch (dtype) {
    case Dtype::kF32:
      return first ? AccumulateRowT<Dtype::kF32, true>(acc, row, hidden, weighted, w)
                   : AccumulateRowT<Dtype::kF32, false>(acc, row, hidden, weighted, w);
    case Dtype::kBF16:
      return first ? AccumulateRowT<Dtype::kBF16, true>(acc, row, hidden, weighted, w)
                   : AccumulateRowT<Dtype::kBF16, false>(acc, row, hidden, weighted, w);
    case Dtype::kF16:
      return first ? AccumulateRowT<Dtype::kF16, true>(acc, row, hidden, weighted, w)
                   : AccumulateRowT<Dtype::kF16, false>(acc, row, hidden, weighted, w);
  }
}

JAX_HYBRIDEP_ROW_KERNEL void StoreRow(void* out, const float* acc, int64_t hidden, Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32:
      return StoreRowT<Dtype::kF32>(out, acc, hidden);
    case Dtype::kBF16:
      return StoreRowT<Dtype::kBF16>(out, acc, hidden);
    case Dtype::kF16:
      return StoreRowT<Dtype::kF16>(out, acc, hidden);
  }
}

JAX_HYBRIDEP_ROW_KERNEL void AccumulateRounded(float* acc, const float* part, int64_t hidden,
                                               Dtype dtype, bool first) {
  switch (dtype) {
    case Dtype::kF32:
      return first ? AccumulateRoundedT<Dtype::kF32, true>(acc, part, hidden)
                   : AccumulateRoundedT<Dtype::kF32, false>(acc, part, hidden);
    case Dtype::kBF16:
      return first ? AccumulateRoundedT<Dtype::kBF16, true>(acc, part, hidden)
                   : AccumulateRoundedT<Dtype::kBF16, false>(acc, part, hidden);
    case Dtype::kF16:
      return first ? AccumulateRoundedT<Dtype::kF16, true>(acc, part, hidden)
                   : AccumulateRoundedT<Dtype::kF16, false>(acc, part, hidden);
  }
}

JAX_HYBRIDEP_ROW_KERNEL void ScaleRow(void* out, const void* in, int64_t hidden, float w,
                                      Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32:
      return ScaleRowT<Dtype::kF32>(out, in, hidden, w);
    case Dtype::kBF16:
      return ScaleRowT<Dtype::kBF16>(out, in, hidden, w);
    case Dtype::kF16:
      return ScaleRowT<Dtype::kF16>(out, in, hidden, w);
  }
}

// A null g is a row of zeros (a padding row).
JAX_HYBRIDEP_ROW_KERNEL float RowDot(const void* y, const void* g, int64_t hidden, Dtype dtype,
                                     float* lanes) {
  switch (dtype) {
    case Dtype::kF32:
      return g != nullptr ? RowDotT<Dtype::kF32, false>(y, g, hidden, lanes)
                          : RowDotT<Dtype::kF32, true>(y, g, hidden, lanes);
    case Dtype::kBF16:
      return g != nullptr ? RowDotT<Dtype::kBF16, false>(y, g, hidden, lanes)
                          : RowDotT<Dtype::kBF16, true>(y, g, hidden, lanes);
    case Dtype::kF16:
      return g != nullptr ? RowDotT<Dtype::kF16, false>(y, g, hidden, lanes)
                          : RowDotT<Dtype::kF16, true>(y, g, hidden, lanes);
  }
  return 0.0f;
}

}  // namespace

void RowSum::Add(const void* row, bool weighted, float w) {
  AccumulateRow(acc_.data(), row, hidden(), dtype_, weighted, w, empty_);
  empty_ = false;
}

void RowSum::AddRounded(const RowSum& part) {
  if (part.empty_) return;  // + (+0): the sum is never -0, so adding +0 changes nothing
  AccumulateRounded(acc_.data(), part.acc_.data(), hidden(), dtype_, empty_);
  empty_ = false;
}

void RowSum::Store(void* out) const {
  if (empty_) {
    std::memset(out, 0, hidden() * DtypeBytes(dtype_));  // +0 in every dtype
  } else {
    StoreRow(out, acc_.data(), hidden(), dtype_);
  }
}

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

namespace {

// out[r] = 0 for every r < rows with filled[r] == 0 (contiguous runs zeroed at once).
void ZeroUnfilledRows(int64_t rows, int64_t row_bytes, const uint8_t* filled, char* out) {
  int64_t r = 0;
  while (r < rows) {
    if (filled[r]) {
      ++r;
      continue;
    }
    int64_t end = r;
    while (end < rows && !filled[end]) ++end;
    std::memset(out + r * row_bytes, 0, (end - r) * row_bytes);
    r = end;
  }
}

// Writes a destination's rows one at a time (Fill), then the rows nobody filled (Finish).
class RowWriter {
 public:
  RowWriter(int64_t rows, int64_t row_bytes, Dtype dtype, const RowOutputs& out)
      : rows_(rows),
        row_bytes_(row_bytes),
        hidden_(row_bytes / DtypeBytes(dtype)),
        dtype_(dtype),
        out_(out),
        filled_(rows, 0),
        lanes_(out.dot != nullptr ? RowDotLanes(hidden_) : 0) {}

  void Fill(const RowSource& src) {
    const int64_t row = src.row;
    filled_[row] = 1;
    if (out_.tokens != nullptr) {
      char* to = out_.tokens + row * row_bytes_;
      if (out_.fp8_hidden > 0) {
        DequantizeRow(reinterpret_cast<const uint8_t*>(src.token), out_.fp8_hidden, dtype_, to);
      } else {
        std::memcpy(to, src.token, row_bytes_);
      }
    }
    if (out_.weights != nullptr) out_.weights[row] = src.weight;
    if (out_.scaled != nullptr) {
      ScaleRow(out_.scaled + row * row_bytes_, src.token, hidden_, out_.scale[row], dtype_);
    }
    if (out_.dot != nullptr) {
      out_.dot[row] = RowDot(out_.y + row * row_bytes_, src.token, hidden_, dtype_, lanes_.data());
    }
  }

  // Asks for the cache lines Fill(src) touches, ahead of it.
  void Prefetch(const RowSource& src) const {
    const int64_t at = src.row * row_bytes_;
    PrefetchRow(src.token, row_bytes_);
    if (out_.y != nullptr) PrefetchRow(out_.y + at, row_bytes_);
    if (out_.tokens != nullptr) PrefetchRowForWrite(out_.tokens + at, row_bytes_);
    if (out_.scaled != nullptr) PrefetchRowForWrite(out_.scaled + at, row_bytes_);
  }

  void Finish() {
    // Only the unfilled rows are written: a large, mostly empty buffer (dropless C) costs one
    // pass over its empty part besides one copy per filled row, or, with a sparse pad multiple,
    // over the padding inside the filled extent only.
    const int64_t end = WrittenRows();
    if (out_.tokens != nullptr) ZeroUnfilledRows(end, row_bytes_, filled_.data(), out_.tokens);
    if (out_.scaled != nullptr) ZeroUnfilledRows(end, row_bytes_, filled_.data(), out_.scaled);
    for (int64_t r = 0; r < rows_; ++r) {
      if (filled_[r]) continue;
      if (out_.weights != nullptr) out_.weights[r] = 0.0f;
      if (r >= end) {
        if (out_.dot != nullptr) out_.dot[r] = 0.0f;  // a padding row's gradient goes nowhere
        continue;
      }
      if (out_.scaled != nullptr) {
        const float v = 0.0f * out_.scale[r];  // what XLA computes for a zero row: -0, NaN too
        if (FloatToBits(v) != 0u) {
          char* row = out_.scaled + r * row_bytes_;
          for (int64_t h = 0; h < hidden_; ++h) StoreFromFloat(row, h, v, dtype_);
        }
      }
      if (out_.dot != nullptr) {
        out_.dot[r] = RowDot(out_.y + r * row_bytes_, nullptr, hidden_, dtype_, lanes_.data());
      }
    }
  }

 private:
  // Rows [0, end) get written: all of them, or the filled extent rounded up to the pad multiple
  // (group offsets are multiples of it, so this is the destination's sum(group_sizes)).
  int64_t WrittenRows() const {
    const int64_t pad = out_.sparse_pad_multiple;
    if (pad <= 0) return rows_;
    int64_t last = rows_;
    while (last > 0 && !filled_[last - 1]) --last;
    return std::min(rows_, (last + pad - 1) / pad * pad);
  }

  int64_t rows_, row_bytes_, hidden_;
  Dtype dtype_;
  RowOutputs out_;
  std::vector<uint8_t> filled_;
  std::vector<float> lanes_;  // RowDot's scratch
};

}  // namespace

int64_t OutputRowBytes(const RowOutputs& out, int64_t row_bytes, Dtype dtype) {
  return out.fp8_hidden > 0 ? out.fp8_hidden * DtypeBytes(dtype) : row_bytes;
}

void WriteRows(int64_t rows, int64_t row_bytes, Dtype dtype, const std::vector<RowSource>& sources,
               const RowOutputs& out) {
  constexpr size_t kAhead = 2;  // rows prefetched this many fills ahead
  RowWriter writer(rows, row_bytes, dtype, out);
  for (size_t i = 0; i < sources.size(); ++i) {
    if (i + kAhead < sources.size()) writer.Prefetch(sources[i + kAhead]);
    writer.Fill(sources[i]);
  }
  writer.Finish();
}

void PullRows(const ExchangeShape& shape, int64_t rank, const SourceRows* sources, Dtype dtype,
              const RowOutputs& out) {
  const int64_t T = shape.tokens, K = shape.k, rb = shape.row_bytes;
  // In row order: the rows written (and y, read by a VJP) are then streamed, and only the
  // sources' token rows are scattered.
  std::vector<RowSource> pulls(shape.rows, RowSource{-1, nullptr, 0.0f});
  for (int64_t src = 0; src < shape.ranks; ++src) {
    const SourceRows& from = sources[src];
    for (int64_t i = 0; i < T * K; ++i) {
      const int32_t row = from.row_pos[i];
      if (from.dest[i] != rank || row < 0) continue;
      pulls[row] = {row, from.x + (i / K) * rb, from.weights != nullptr ? from.weights[i] : 0.0f};
    }
  }
  pulls.erase(std::remove_if(pulls.begin(), pulls.end(),
                             [](const RowSource& pull) { return pull.row < 0; }),
              pulls.end());
  WriteRows(shape.rows, OutputRowBytes(out, rb, dtype), dtype, pulls, out);
}

void PullCombine(const ExchangeShape& shape, Dtype dtype, const char* const* y,
                 const float* const* weights, const int32_t* dest, const int32_t* row_pos,
                 char* out) {
  const int64_t T = shape.tokens, K = shape.k, rb = shape.row_bytes;
  const int64_t hidden = rb / DtypeBytes(dtype);
  RowSum acc(hidden, dtype), part(hidden, dtype);
  std::vector<int32_t> dests(K);
  for (int64_t t = 0; t < T; ++t) {
    if (t + 1 < T) {  // the next token's rows are scattered over the peers' y: fetch them early
      for (int64_t j = 0; j < K; ++j) {
        const int32_t d = dest[(t + 1) * K + j], row = row_pos[(t + 1) * K + j];
        if (d >= 0 && row >= 0) PrefetchRow(y[d] + row * rb, rb);
      }
    }
    acc.Clear();
    const int64_t num_dests = DistinctDestinations(dest + t * K, K, dests.data());
    for (int64_t i = 0; i < num_dests; ++i) {
      const int32_t d = dests[i];
      const int32_t* rows = row_pos + t * K;
      const int64_t count = std::count(dest + t * K, dest + (t + 1) * K, d);
      if (weights == nullptr && count == 1) {
        // A partial of one unweighted row is that row (0 + x rounded back to the row's dtype is
        // x, except -0 -> +0, which adds to acc the same: acc starts at +0 and never becomes
        // -0), so it is added directly.
        const int64_t j = std::find(dest + t * K, dest + (t + 1) * K, d) - (dest + t * K);
        if (rows[j] >= 0) acc.Add(y[d] + rows[j] * rb);
        continue;
      }
      part.Clear();
      for (int64_t j = 0; j < K; ++j) {
        if (dest[t * K + j] != d || rows[j] < 0) continue;
        part.Add(y[d] + rows[j] * rb, weights != nullptr,
                 weights != nullptr ? weights[d][rows[j]] : 1.0f);
      }
      acc.AddRounded(part);  // the partial crosses as dtype
    }
    acc.Store(out + t * rb);
  }
}

void PullRowValues(const ExchangeShape& shape, const float* const* values, const int32_t* dest,
                   const int32_t* row_pos, float* out) {
  for (int64_t i = 0; i < shape.tokens * shape.k; ++i) {
    out[i] = dest[i] >= 0 && row_pos[i] >= 0 ? values[dest[i]][row_pos[i]] : 0.0f;
  }
}

}  // namespace jax_hybridep
