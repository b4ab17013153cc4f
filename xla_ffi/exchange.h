// The steps of one direct-write exchange level, on the host (DESIGN §2.1, §3).
//
// Dispatch: every source rank writes one copy of each token per destination rank straight into
// that destination's receive buffer (WriteTokens), then each destination expands its receive buffer
// into expert-major rows (ExpandRows). Combine runs the reverse: each destination sums its rows per
// received token and writes the partial into the source's buffer (WritePartials), and the source
// adds the partials in ascending destination rank (ReducePartials).
//
// These write-based steps are the protocol the CUDA kernels implement (and are checked against).
// The host handlers use the equivalent pull transport below, which needs no staging copy.
//
// Framework-free: raw pointers only. The caller provides the peers' buffers (shared process memory)
// and the barriers between the write and read steps.
#ifndef JAX_HYBRIDEP_XLA_FFI_EXCHANGE_H_
#define JAX_HYBRIDEP_XLA_FFI_EXCHANGE_H_

#include <cstdint>

#include "xla_ffi/numeric.h"

namespace jax_hybridep {

// Geometry shared by all ranks of one exchange.
struct ExchangeShape {
  int64_t ranks;      // R, ranks at this level
  int64_t tokens;     // T, tokens per source rank (the most one source can send one destination)
  int64_t k;          // K, routing slots per token
  int64_t rows;       // C, rows of the expert-major buffer
  int64_t row_bytes;  // H * element size
};

// A destination's receive buffer for dispatch. Slot (src, j) holds the j-th token that source
// `src` sends here; its metadata says which rows it expands into.
struct DispatchRecvBuffer {
  char* tokens;        // [R, T, row_bytes]
  int32_t* token_ids;  // [R, T]: the source's token index t, -1 for an empty slot
  int32_t* row_pos;    // [R, T, K]: destination row per k, -1 when (t, k) has no row here
  float* weights;      // [R, T, K]: routing weight per k
};

// Prepares a destination's metadata before peers write into it: all slots empty.
void ClearRecvMetadata(const ExchangeShape& shape, int32_t* token_ids, int32_t* row_pos);

// Source `rank` writes its tokens into every destination's receive buffer: for destination d, the
// tokens with at least one row on d, in ascending t, one copy each. dest: [T, K] destination rank
// of each kept (t, k), -1 otherwise. weights may be null (then 0 is sent).
void WriteTokens(const ExchangeShape& shape, int64_t rank, const char* x, const int32_t* dest,
                 const int32_t* row_pos, const float* weights, DispatchRecvBuffer* const* peers);

// Expands a destination's receive buffer into expert-major rows; rows nobody fills are zero.
// out_tokens: [C, row_bytes]; out_weights: [C].
void ExpandRows(const ExchangeShape& shape, const DispatchRecvBuffer& recv, char* out_tokens,
                float* out_weights);

// ---------------------------------------------------------------------------- pull transport
// Inside one process every rank can read its peers' inputs once all have arrived, so the host
// handlers of the one-level exchange read straight from the peers instead of staging a copy
// first: a destination copies each of its rows from the source's x (one copy per row instead of a
// copy per (token, destination) into a receive buffer plus one per row out of it), and a source
// sums its partials from the destinations' rows. Same results, bit for bit, as WriteTokens +
// ExpandRows and WritePartials + ReducePartials (the same adds in the same order; each partial
// is still rounded to the row dtype before the source adds it).

// One source's dispatch inputs as a destination reads them.
struct SourceRows {
  const char* x;           // [T, row_bytes]
  const int32_t* dest;     // [T, K]: destination rank per kept (t, k), else -1
  const int32_t* row_pos;  // [T, K]: row on that destination
  const float* weights;    // [T, K], or null (weights 0)
};

// Destination `rank`: out_tokens[row] = the source's token for every row it holds, rows nobody
// fills zeroed; out_weights[row] = its routing weight (out_weights may be null); with out_scaled,
// also out_scaled[row] = out_tokens[row] * scale[row] in float32 rounded to `dtype` (combine's
// weighted VJP; rows nobody fills get 0 * scale[row], as XLA computes them: -0 for negative
// scales, NaN for infinite ones).
void PullRows(const ExchangeShape& shape, int64_t rank, const SourceRows* sources, Dtype dtype,
              const float* scale, char* out_tokens, float* out_weights, char* out_scaled);

// Source side of combine: out[t] = sum over its destinations d ascending of the partial
// round_to_dtype(sum over k ascending with dest[t, k] == d of y[d][row_pos[t, k]] (times
// weights[d][row] when weights is non-null)), in float32, rounded once to `dtype`.
void PullCombine(const ExchangeShape& shape, Dtype dtype, const char* const* y,
                 const float* const* weights, const int32_t* dest, const int32_t* row_pos,
                 char* out);

// out[t, k] = values[dest[t, k]][row_pos[t, k]] for kept (t, k), else 0.
void PullRowValues(const ExchangeShape& shape, const float* const* values, const int32_t* dest,
                   const int32_t* row_pos, float* out);

// Row kernels shared with the level steps (numeric.h's *RowT by dtype, compiled for several x86
// vector extensions and picked at load time; results are the same bits on each).
void AccumulateRow(float* acc, const void* row, int64_t hidden, Dtype dtype, bool weighted,
                   float w);
void StoreRow(void* out, const float* acc, int64_t hidden, Dtype dtype);
void ScaleRow(void* out, const void* in, int64_t hidden, float w, Dtype dtype);

// Row bookkeeping shared with the level steps: out[r] for every r < rows with filled[r] == 0
// becomes zero (contiguous runs zeroed at once); with scale non-null, out_scaled[r] becomes
// 0 * scale[r] rounded to `dtype` (zero unless scale[r] is negative or not finite).
void ZeroUnfilledRows(int64_t rows, int64_t row_bytes, const uint8_t* filled, char* out);
void FillUnfilledScaled(int64_t rows, int64_t row_bytes, const uint8_t* filled, Dtype dtype,
                        const float* scale, char* out_scaled);

// Destination `rank` sums, for every token it received, its rows in ascending k in float32
// (each row times `weights[row]` when weights is non-null), rounds the partial to `dtype`, and
// writes it into the source's partial buffer at [rank, t]. peer_partials[src]: [R, T, row_bytes].
void WritePartials(const ExchangeShape& shape, int64_t rank, Dtype dtype, const char* y,
                   const float* weights, const int32_t* token_ids, const int32_t* recv_row_pos,
                   char* const* peer_partials);

// Source side of combine: out[t] = sum over destinations d holding a row of t, in ascending d, of
// partials[d, t], in float32, rounded once to `dtype`. dest: [T, K] as in WriteTokens.
void ReducePartials(const ExchangeShape& shape, Dtype dtype, const char* partials,
                    const int32_t* dest, char* out);

// A destination returns one float per received (t, k), values[recv_row_pos], into the source's
// [T, K] buffer (the routing-weight gradient). peer_out[src]: [T, K], zeroed by its owner.
void WriteRowValues(const ExchangeShape& shape, const float* values, const int32_t* token_ids,
                    const int32_t* recv_row_pos, float* const* peer_out);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_EXCHANGE_H_
