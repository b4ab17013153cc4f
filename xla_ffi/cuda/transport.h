// The direct-write transport on GPUs over one level (docs/design.md §2.1, §3): each rank writes its
// tokens straight into its peers' registered windows, each destination expands what it received
// into expert-major rows; combine runs the reverse. Framework-free: raw device pointers and a
// stream.
//
// Protocol. Every exchange has a generation g (1, 2, ...: one per exchange call on a window, the
// same sequence on every rank) and uses the window half g % 2. A send phase runs as `send_blocks`
// persistent blocks; block b handles items b, b + send_blocks, ... and, when done, stores g into
// arrived[b] of its own rank's row in every peer's window (a system-scope release after a fence),
// so there is no synchronisation between blocks and receivers can start on the items of a block
// as soon as that block is done. A receive phase waits, per item, for the flag of the sender block
// that handled it (an acquire). Reusing a half is safe without any extra handshake: a rank writes
// half g % 2 again only at g + 2, after it saw every peer's flag for g + 1, which each peer sets
// only after it finished reading g (one stream per rank orders its receive of g before its send of
// g + 1). Waits give up after `timeout_ns` (device global timer), record the first failure in the
// mapped host error record and return; the host reports it on the next call (never a hang).
//
// The same __device__ phases (transport_phases.cuh) run in the per-rank kernels of the FFI handlers
// (transport_kernels.cu: one launch per rank and phase) and in the test module's virtual-rank
// harness (testing/transport_harness.h: all ranks of a group in one cooperative launch on one GPU),
// so the protocol is tested on a single GPU. The window's regions are in window_layout.h.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_TRANSPORT_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_TRANSPORT_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "xla_ffi/cuda/window_layout.h"
#include "xla_ffi/limits.h"  // kMaxSendBlocks, kMaxTopK
#include "xla_ffi/numeric.h"

namespace jax_hybridep {

// Where a failed wait is recorded: in mapped host memory, written once (first failure wins).
struct TransportError {
  uint32_t code;   // 0: none; 1: a wait timed out; 2: a flag of another exchange (v2)
  uint32_t rank;   // the rank that waited
  uint32_t peer;   // the source rank it waited for
  uint32_t block;  // the sender block whose flag never came
  uint64_t generation;
  uint64_t seen;      // v2: the flag the failed wait read last
  uint64_t expected;  // v2: the tag it waited for (v2_transport.h)
};

// What every phase of one exchange needs. Every receive phase runs as `send_blocks` blocks too:
// receiving block b handles the items sending block b wrote, so it waits on flags arrived[., b].
struct ExchangeContext {
  const Window* windows;  // device array [R]: every rank's window, addressable from this device
  int64_t ranks;          // R
  int64_t tokens;         // T
  int64_t k;              // K
  int64_t row_bytes;      // bytes of this exchange's rows (<= the window's)
  int32_t rank;           // this rank
  uint64_t generation;    // this exchange's generation, >= 1
  int32_t send_blocks;    // blocks of every rank's send phase (<= kMaxSendBlocks)
  int64_t timeout_ns;     // how long a wait may spin
  TransportError* error;  // device pointer to the mapped host record
};

// ---- Per-rank launches (the FFI handlers); each returns the launch status, never synchronises.

// Dispatch send: for every token t with at least one kept row, one copy of x[t] to each distinct
// destination's window (dest [T, K], -1 = no row); with `row_pos`, also every destination's
// metadata for t (its rows of t, -1 elsewhere, and the weights; weights may be null: 0 sent).
// Without `row_pos` only rows move (redispatch along an existing layout).
cudaError_t LaunchSendTokens(const ExchangeContext& ctx, const char* x, const int32_t* dest,
                             const int32_t* row_pos, const float* weights, cudaStream_t stream);

// Dispatch receive: out_tokens [C, row_bytes] gets each received token in each of its rows
// (out_tokens zeroed beforehand by the caller), out_weights [C] its routing weight, and
// recv_row_pos [R * T, K] the metadata (the handle's map of rows to (source, t, k)).
cudaError_t LaunchReceiveRows(const ExchangeContext& ctx, char* out_tokens, float* out_weights,
                              int32_t* recv_row_pos, int64_t rows, cudaStream_t stream);

// Dispatch with FP8 on the wire (docs/design.md §2.1.8): the window slots hold wire rows of
// `hidden` elements (ctx.row_bytes == Fp8WireBytes(hidden)). The quantising send reads x [T,
// hidden] of `dtype` and writes each token's wire row, quantised once (fp8.h's steps, a block's
// amax reduced over a warp's lanes), to each distinct destination, metadata as LaunchSendTokens;
// the dequantising receive writes each wire row as float32(q) * scale rounded to `dtype` into
// out_tokens [C, hidden] (zeroed first). Wire rows quantised before the transport (slower levels
// carried them) go through LaunchSendTokens, and FP8 rows out through LaunchReceiveRows, as bytes.
cudaError_t LaunchSendTokensQuantized(const ExchangeContext& ctx, Dtype dtype, int64_t hidden,
                                      const char* x, const int32_t* dest, const int32_t* row_pos,
                                      const float* weights, cudaStream_t stream);
cudaError_t LaunchReceiveRowsDequantized(const ExchangeContext& ctx, Dtype dtype, int64_t hidden,
                                         char* out_tokens, float* out_weights,
                                         int32_t* recv_row_pos, int64_t rows, cudaStream_t stream);

// Redispatch receive along an existing layout (recv_row_pos from the dispatch): out_tokens as
// above and, when `scale` is non-null, out_scaled[row] = out_tokens[row] * scale[row] in float32
// rounded to `dtype` (combine's weighted VJP). The caller prefills both (PrefillRedispatch).
cudaError_t LaunchReceiveRedispatch(const ExchangeContext& ctx, Dtype dtype,
                                    const int32_t* recv_row_pos, const float* scale,
                                    char* out_tokens, char* out_scaled, cudaStream_t stream);

// Zeroes out_tokens [C, row_bytes] and sets out_scaled[row] = 0 * scale[row] rounded to `dtype`
// (as XLA computes the product for rows nobody fills: -0 for negative scales, NaN for infinite).
cudaError_t LaunchPrefillRedispatch(int64_t rows, int64_t row_bytes, Dtype dtype,
                                    const float* scale, char* out_tokens, char* out_scaled,
                                    cudaStream_t stream);

// Combine send (destination side): for every received (source, t), the float32 sum over
// ascending k of y[row] (times weights[row] when non-null), rounded to `dtype`, written into the
// source's window. y: [C, H]; recv_row_pos: [R * T, K].
cudaError_t LaunchSendPartials(const ExchangeContext& ctx, Dtype dtype, const char* y,
                               const float* weights, const int32_t* recv_row_pos,
                               cudaStream_t stream);

// Combine receive (source side): out[t] = the float32 sum of its partials over the distinct
// destinations of dest[t, :] in ascending rank, rounded once to `dtype`. out: [T, row_bytes].
cudaError_t LaunchReducePartials(const ExchangeContext& ctx, Dtype dtype, const int32_t* dest,
                                 char* out, cudaStream_t stream);

// Row values back to their (t, k) (the routing-weight gradient): the destination sends
// values[row] for every received row; the source reads out[t, k] from destination dest[t, k]
// (0 where dest is -1).
cudaError_t LaunchSendRowValues(const ExchangeContext& ctx, const float* values,
                                const int32_t* recv_row_pos, cudaStream_t stream);
cudaError_t LaunchReceiveRowValues(const ExchangeContext& ctx, const int32_t* dest, float* out,
                                   cudaStream_t stream);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_TRANSPORT_H_
