// The GPU transport of the fastest level, on Hybrid-EP's structure (docs/gpu.md; docs/design.md
// §2.1 is the contract): its kernels' launchers. Framework-free: raw device pointers and a
// stream; every launcher returns the launch status.
//
// What moves and where. The slot map (slot_map.h) gives every (item, destination GPU) its dense
// slot in the destination's receive buffer and every receiver the map of its slots to rows, both
// computed on every rank from the level's all-gathered routing: no metadata travels with the
// payload. An exchange is then
//   * a send phase: `send_blocks` persistent blocks of one G2S warp and kS2GWarps S2G warps;
//     block b takes the chunks of kSendChunk consecutive items c = b, b + send_blocks, ...; the
//     chunk's row map is bulk-loaded into a double-buffered shared slot, each item's row into one
//     of `stages` whole-row stages (> 48 KiB of dynamic shared memory, opted in: send_plan.h),
//     and one elected lane of an S2G warp stores it with one cp.async.bulk global <- shared per
//     (item, destination GPU) into the peers' windows (their bases a __grid_constant__
//     parameter). The block then raises its flag in every peer's window;
//   * a receive phase as a wide kernel on every SM (the transport's blocks are done by then): it
//     waits for every (source, send block) flag, then permutes the dense slots into expert-major
//     rows (dispatch; only padding rows are zeroed besides) or sums each item's partials (combine).
// Combine first unpermutes on this rank (each received item's rows summed in float32 in
// ascending k, rounded once: a wide local kernel), then sends one partial per (source, item).
//
// Flags and expected values live in device memory. Every rank's window (state/window_regions.h)
// holds an exchange counter (`epoch`) that the last block of each exchange's final kernel advances,
// so a kernel reads its exchange number from memory (graph-capturable, no counter in the handlers),
// and each flag carries a tag of (exchange number, call site). A wait accepts its own tag, or the
// next exchange's number (a peer already one exchange ahead writes the other window half); a flag
// of the same exchange from another call site, or from further ahead, means the ranks disagree on
// the exchange sequence: the wait records a mismatch and gives up. A wait also gives up after
// `timeout_ns`. Failures are recorded in the mapped record (pinned memory every GPU reaches)
// (TransportError: kWaitTimeout, kWaitMismatch) and reported at the next call (window_registry.h
// WindowError). Half reuse is safe: a rank writes half g % 2 again only at g + 2, after it saw
// every peer's flag of g + 1, which each peer raises only after it finished reading g.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_TRANSPORT_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_TRANSPORT_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "xla_ffi/common/limits.h"
#include "xla_ffi/common/numeric.h"
#include "xla_ffi/cuda/kernels/send_plan.h"
#include "xla_ffi/cuda/state/window_regions.h"

namespace jax_hybridep {

// What every kernel of one exchange needs, besides the peers.
struct ExchangeParams {
  WindowRegions window;
  char* own;              // this rank's window, as this device addresses it
  int32_t ranks;          // S, the level's GPUs
  int32_t rank;           // this GPU's coordinate in the level
  int64_t items;          // M, items per rank (the window's)
  int64_t row_bytes;      // bytes of this exchange's rows in the window (<= slot_stride)
  int32_t send_blocks;    // blocks of every rank's send phase (<= kMaxSendBlocks)
  uint32_t site;          // the call site, part of every flag's tag
  int64_t timeout_ns;     // how long a wait may spin
  TransportError* error;  // device address of the mapped record
};

// ---------------------------------------------------------------------------- send

// Dispatch send: item m of x [items, x_row_bytes] to slot send_slot[m, p] of every peer p where
// it is >= 0 (send_slot: [ChunkPadded(items), ranks]). With fp8 (dtype, hidden > 0) x is
// [items, hidden] of dtype and each row is quantised into its wire row (fp8.h) on the way.
cudaError_t LaunchSendRows(const ExchangeParams& ex, const PeerWindows& peers, const char* x,
                           int64_t x_row_bytes, const int32_t* send_slot, Dtype fp8_dtype,
                           int64_t fp8_hidden, cudaStream_t stream);

// Combine send: partial j of partials [>= n, row_bytes] (n = info[0] slots received in the
// dispatch) to its source s at slot (this rank * items + m), where recv_item[j] = s * items + m.
cudaError_t LaunchSendPartials(const ExchangeParams& ex, const PeerWindows& peers,
                               const char* partials, const int32_t* recv_item, const int32_t* info,
                               cudaStream_t stream);

// ---------------------------------------------------------------------------- receive

// Rows past the received ones that a permute zeroes: all (pad_multiple 0), or those below
// round_up(last received row + 1, pad_multiple) (DispatchConfig(zero_padding=False)).
struct PaddingFill {
  int64_t rows;          // C
  int64_t pad_multiple;  // 0: zero every row nobody fills
};

// Dispatch receive: waits for every peer's flags, then out [C, out_row_bytes] gets slot j's
// payload in each row recv_rows[j, :] (>= 0) for j < info[0], and the rows nobody fills
// (row_slot[r] < 0) zeroes (PaddingFill). With fp8 (dtype, hidden > 0) the slots hold FP8 wire
// rows, dequantised into rows of dtype.
cudaError_t LaunchPermute(const ExchangeParams& ex, int64_t k, const int32_t* recv_rows,
                          const int32_t* row_slot, const int32_t* info, const PaddingFill& fill,
                          char* out, int64_t out_row_bytes, Dtype fp8_dtype, int64_t fp8_hidden,
                          cudaStream_t stream);

// Redispatch receive (combine's VJP): as the dispatch receive, and with `scale` [C] also
// out_scaled[r] = out[r] * scale[r] in float32 rounded to dtype (0 * scale[r] where nobody
// fills r, as XLA computes it: -0 for negative scales, NaN for infinite ones).
cudaError_t LaunchPermuteScaled(const ExchangeParams& ex, int64_t k, Dtype dtype,
                                const int32_t* recv_rows, const int32_t* row_slot,
                                const int32_t* info, const PaddingFill& fill, const float* scale,
                                char* out, char* out_scaled, cudaStream_t stream);

// Combine, first step (local, no exchange): partials[j] = the float32 sum over ascending k of
// y[recv_rows[j, k]] (times weights[row] when weights is non-null), rounded once to dtype, for
// j < info[0]. y: [C, hidden]; partials: [>= info[0], hidden].
cudaError_t LaunchUnpermute(Dtype dtype, int64_t hidden, int64_t k, const char* y,
                            const float* weights, const int32_t* recv_rows, const int32_t* info,
                            int64_t slots, char* partials, cudaStream_t stream);

// Combine receive: waits for every peer's flags, then out[m] = the float32 sum of the partials
// of m's distinct destinations dest[m, :] in ascending rank, rounded once (0 for none).
cudaError_t LaunchReduce(const ExchangeParams& ex, Dtype dtype, int64_t k, const int32_t* dest,
                         char* out, cudaStream_t stream);

// ---------------------------------------------------------------------------- attributes

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_TRANSPORT_H_
