// The steps of one exchange level on the CPU (docs/design.md §2.1, §3), as the host handlers run
// them.
//
// Inside one process every rank reads its peers' inputs once all have arrived ("pull transport"):
// a destination copies each of its rows straight from the source's x, and a source sums its
// partials from the destinations' rows, each partial rounded to the row dtype before the source
// adds it (the order of docs/design.md §2.1.4: ascending k within a destination, ascending
// destination).
// The GPU transport (xla_ffi/cuda/kernels/transport.h) writes the same rows and sums by writing
// into its peers instead, bit for bit (tests/cuda_transport_test.py checks both against one numpy
// model).
//
// Framework-free: raw pointers only. The caller provides the peers' buffers (shared process memory)
// and the barriers between the write and read steps.
#ifndef JAX_HYBRIDEP_XLA_FFI_CPU_KERNELS_EXCHANGE_H_
#define JAX_HYBRIDEP_XLA_FFI_CPU_KERNELS_EXCHANGE_H_

#include <cstdint>
#include <vector>

#include "xla_ffi/common/numeric.h"

namespace jax_hybridep {

// Geometry shared by all ranks of one exchange.
struct ExchangeShape {
  int64_t ranks;      // R, ranks at this level
  int64_t tokens;     // T, tokens per source rank (the most one source can send one destination)
  int64_t k;          // K, routing slots per token
  int64_t rows;       // C, rows of the expert-major buffer
  int64_t row_bytes;  // H * element size
};

// One source's dispatch inputs as a destination reads them.
struct SourceRows {
  const char* x;           // [T, row_bytes]
  const int32_t* dest;     // [T, K]: destination rank per kept (t, k), else -1
  const int32_t* row_pos;  // [T, K]: row on that destination
  const float* weights;    // [T, K], or null (weights 0)
};

// What a destination writes for its expert-major rows (PullRows, levels.h ExpandItems): any subset;
// null members are not written. Rows nobody fills are written as rows of zeros would be.
struct RowOutputs {
  char* tokens = nullptr;        // [C, row_bytes]: the rows
  float* weights = nullptr;      // [C]: each row's routing weight (0 where unfilled)
  const float* scale = nullptr;  // [C], used with `scaled`
  char* scaled = nullptr;        // [C, row_bytes]: row * scale[row] in float32, rounded to dtype
                                 // (unfilled: 0 * scale[row], as XLA computes it: -0 or NaN too)
  const char* y = nullptr;       // [C, row_bytes], used with `dot`
  float* dot = nullptr;          // [C]: RowDot(y[row], row) (numeric.h's order)
  // > 0 (DispatchConfig(zero_padding=False)): rows at or past the filled extent rounded up to this
  // multiple (the destination's sum(group_sizes)) are left as they are in tokens and scaled,
  // and their dot is 0; the padding inside that extent is still written. 0: every row written.
  int64_t sparse_pad_multiple = 0;
  // > 0: the sources are FP8 wire rows of this many elements (xla_ffi/common/fp8.h), written to
  // `tokens` dequantised to the dtype (row_bytes = fp8_hidden * its size); 0: copied as they are.
  int64_t fp8_hidden = 0;
};

// The bytes of one output row: a dequantised row when the sources are FP8 wire rows, else the
// source row's `row_bytes`.
int64_t OutputRowBytes(const RowOutputs& out, int64_t row_bytes, Dtype dtype);

// One row a destination writes: the token `token` [row_bytes] with routing weight `weight`.
struct RowSource {
  int32_t row;
  const char* token;
  float weight;
};

// Writes every row of `sources` (in that order, each row at most once) into `out`, then the
// rows nobody filled.
void WriteRows(int64_t rows, int64_t row_bytes, Dtype dtype, const std::vector<RowSource>& sources,
               const RowOutputs& out);

// Destination `rank`: every row it holds, straight from its source's x (with the source's
// routing weight, 0 when the source has none), into `out`.
void PullRows(const ExchangeShape& shape, int64_t rank, const SourceRows* sources, Dtype dtype,
              const RowOutputs& out);

// Source side of combine: out[t] = sum over its destinations d ascending of the partial
// round_to_dtype(sum over k ascending with dest[t, k] == d of y[d][row_pos[t, k]] (times
// weights[d][row] when weights is non-null)), in float32, rounded once to `dtype`.
void PullCombine(const ExchangeShape& shape, Dtype dtype, const char* const* y,
                 const float* const* weights, const int32_t* dest, const int32_t* row_pos,
                 char* out);

// out[t, k] = values[dest[t, k]][row_pos[t, k]] for kept (t, k), else 0.
void PullRowValues(const ExchangeShape& shape, const float* const* values, const int32_t* dest,
                   const int32_t* row_pos, float* out);

// A float32 sum of rows that starts at +0, as a buffer filled with zeros would, but neither
// fills nor reads it before the first add (numeric.h's row kernels, vectorised for the CPU it
// runs on; the same bits on each). Reused across sums (Clear); not thread-safe.
class RowSum {
 public:
  RowSum(int64_t hidden, Dtype dtype) : acc_(hidden), dtype_(dtype) {}

  void Clear() { empty_ = true; }
  // sum += row (times w when weighted).
  void Add(const void* row, bool weighted = false, float w = 1.0f);
  // sum += part rounded to the dtype: a partial that crosses as the row dtype.
  void AddRounded(const RowSum& part);
  // out = sum rounded to the dtype.
  void Store(void* out) const;

 private:
  int64_t hidden() const { return static_cast<int64_t>(acc_.size()); }

  std::vector<float> acc_;
  Dtype dtype_;
  bool empty_ = true;
};

// Asks for a row's cache lines ahead of its use: rows are read in routing order, scattered over
// memory, where the hardware prefetcher cannot see them coming (on the CPU benchmark preset this
// took ~20% off a forward + backward step).
inline void PrefetchRow(const char* row, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset);
}

// The same for a row about to be written.
inline void PrefetchRowForWrite(char* row, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset, 1);
}

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CPU_KERNELS_EXCHANGE_H_
