// Transport v2 of the fastest level on GPUs, on Hybrid-EP's structure (docs/gpu.md "Transport
// v2"; docs/design.md §2.1 is the contract, the same bits as transport v1 in transport.h).
//
// What moves and where. The layout (v2_layout.h) gives every (item, destination GPU) its dense
// slot in the destination's receive buffer and every receiver the map of its slots to rows, both
// computed on every rank from the level's all-gathered routing: no metadata travels with the
// payload. An exchange is then
//   * a send phase: `send_blocks` persistent blocks of one G2S warp and kV2S2GWarps S2G warps;
//     block b takes the chunks of kV2Chunk consecutive items c = b, b + send_blocks, ...; the
//     chunk's row map is bulk-loaded into a double-buffered shared slot, each item's row into one
//     of `stages` whole-row stages (> 48 KiB of dynamic shared memory, opted in), and one elected
//     lane of an S2G warp stores it with one cp.async.bulk global <- shared per (item,
//     destination GPU) into the peers' windows (their bases a __grid_constant__ parameter). The
//     block then raises its flag in every peer's window;
//   * a receive phase as a wide kernel on every SM (the transport's blocks are done by then): it
//     waits for every (source, send block) flag, then permutes the dense slots into expert-major
//     rows (dispatch; only padding rows are zeroed besides) or sums each item's partials (combine).
// Combine first unpermutes on this rank (each received item's rows summed in float32 in
// ascending k, rounded once: a wide local kernel), then sends one partial per (source, item).
//
// Flags and expected values live in device memory. Every rank's window holds an exchange counter
// (`epoch`) that the last block of each exchange's final kernel advances, so a kernel reads its
// exchange number from memory (graph-capturable, no host counter), and each flag carries a tag of
// (exchange number, call site). A wait accepts its own tag, or the next exchange's number (a peer
// already one exchange ahead writes the other window half); a flag of the same exchange from
// another call site, or from further ahead, means the ranks disagree on the exchange sequence:
// the wait records a mismatch and gives up. A wait also gives up after `timeout_ns`. Failures are
// recorded in the mapped host record (transport.h TransportError, codes kV2Timeout/kV2Mismatch)
// and reported at the next call (windows.h WindowError). Half reuse is safe as in v1: a rank
// writes half g % 2 again only at g + 2, after it saw every peer's flag of g + 1.
//
// Framework-free: raw device pointers and a stream; every launcher returns the launch status.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_V2_TRANSPORT_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_V2_TRANSPORT_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "xla_ffi/cuda/transport.h"  // WindowGeometry, TransportError
#include "xla_ffi/cuda/v2_layout.h"  // kV2Chunk
#include "xla_ffi/limits.h"
#include "xla_ffi/numeric.h"

namespace jax_hybridep {

// The send block: one G2S warp (loads), kV2S2GWarps warps storing to the peers.
constexpr int kV2S2GWarps = 3;
constexpr int kV2SendThreads = 32 * (1 + kV2S2GWarps);
constexpr int kV2SendRegisters = 96;
// Combine sends one partial per (source, item), on at most this many blocks (DispatchConfig's
// num_sms when fewer): 8 SMs at the ~56 GB/s an SM's bulk stores are built for fill an NVLink4
// direction (450 GB/s); the wide unpermute before it runs on every SM.
constexpr int kV2CombineMaxBlocks = 8;
// Whole-row stages a send block keeps in flight, at most, and the fewest a row may be cut into
// pieces for (rows too large for kV2MinStages whole stages travel in pieces).
constexpr int kV2MaxStages = 12;
constexpr int kV2MinStages = 4;
// A stage goes back to the G2S warp when its S2G warp commits its next row, so the ring must be
// deeper than the S2G warps (or the G2S warp could wait for a stage no warp will release).
static_assert(kV2MinStages > kV2S2GWarps, "the ring must be deeper than the S2G warps");
// Dynamic shared memory a block may opt into on sm_90 and sm_100 (227 KiB).
constexpr int64_t kV2SharedBudget = 232448;

// Error codes of TransportError beside v1's 1 (a wait timed out).
constexpr uint32_t kV2Timeout = 1;
constexpr uint32_t kV2Mismatch = 2;

// ---------------------------------------------------------------------------- windows

// Byte offsets of a v2 window's regions from its base (the same on every rank of a group).
struct V2WindowLayout {
  int64_t slot_stride;  // bytes of one payload slot (row bytes rounded up to 16)
  int64_t slots;        // slots per half: ranks * items (dense dispatch slots or combine partials)
  int64_t payload[2];   // [slots, slot_stride] each
  int64_t arrived;      // uint64 [ranks, kMaxSendBlocks]: the tag each source block last raised
  int64_t epoch;        // uint64: exchanges this rank finished on the window
  int64_t done;         // uint32: blocks of the running exchange's final kernel that finished
  int64_t error_claim;  // uint32: set by the first failed wait of this rank
  int64_t total;
};

// geometry.tokens is the level's items per rank (M); geometry.k is not used.
V2WindowLayout V2Layout(const WindowGeometry& geometry);
size_t V2WindowBytes(const WindowGeometry& geometry);

// Every rank's window base as this device addresses it (a __grid_constant__ kernel parameter).
struct V2Peers {
  char* base[kMaxWindowRanks];
};

// What every kernel of one exchange needs, besides the peers.
struct V2Exchange {
  V2WindowLayout window;
  char* own;              // this rank's window, as this device addresses it
  int32_t ranks;          // S, the level's GPUs
  int32_t rank;           // this GPU's coordinate in the level
  int64_t items;          // M, items per rank (the window's)
  int64_t row_bytes;      // bytes of this exchange's rows in the window (<= slot_stride)
  int32_t send_blocks;    // blocks of every rank's send phase (<= kMaxSendBlocks)
  uint32_t site;          // the call site, part of every flag's tag
  int64_t timeout_ns;     // how long a wait may spin
  TransportError* error;  // device address of the mapped host record
};

// ---------------------------------------------------------------------------- send

// How a send kernel stages its rows (host arithmetic; tests check it against the issue's
// figures: H = 7168 bf16 gets >= 10 whole-row stages in >= 140 KiB).
struct V2SendPlan {
  int64_t stage_bytes;  // bytes of one stage (a whole row, or a piece of one)
  int64_t pieces;       // stages per row (1: whole rows)
  int64_t stages;       // ring depth
  int64_t map_bytes;    // one of the two row-map slots
  int64_t scale_bytes;  // FP8: per S2G warp, the block scales of the row it quantises
  int64_t smem_bytes;   // dynamic shared memory of the launch
};

// staged_bytes: bytes of an item's row as loaded (x's row; FP8: the 16-bit token); map_words:
// int32 entries of the row map per item (ranks for dispatch, 1 for combine); fp8_hidden: H when
// the S2G warps quantise the staged row into an FP8 wire row (needs whole-row stages), else 0.
// Fails (stages = 0) when nothing fits `budget`.
V2SendPlan PlanV2Send(int64_t staged_bytes, int64_t map_words, int64_t fp8_hidden,
                      int64_t budget = kV2SharedBudget);

// Dispatch send: item m of x [items, x_row_bytes] to slot send_slot[m, p] of every peer p where
// it is >= 0 (send_slot: [round_up(items, kV2Chunk), ranks]). With fp8 (dtype, hidden > 0) x is
// [items, hidden] of dtype and each row is quantised into its wire row (fp8.h) on the way.
cudaError_t LaunchV2SendRows(const V2Exchange& ex, const V2Peers& peers, const char* x,
                             int64_t x_row_bytes, const int32_t* send_slot, Dtype fp8_dtype,
                             int64_t fp8_hidden, cudaStream_t stream);

// Combine send: partial j of partials [>= n, row_bytes] (n = info[0] slots received in the
// dispatch) to its source s at slot (this rank * items + m), where recv_item[j] = s * items + m.
cudaError_t LaunchV2SendPartials(const V2Exchange& ex, const V2Peers& peers, const char* partials,
                                 const int32_t* recv_item, const int32_t* info,
                                 cudaStream_t stream);

// ---------------------------------------------------------------------------- receive

// Rows past the received ones that a permute zeroes: all (pad_multiple 0), or those below
// round_up(last received row + 1, pad_multiple) (DispatchConfig(zero_padding=False)).
struct V2Fill {
  int64_t rows;          // C
  int64_t pad_multiple;  // 0: zero every row nobody fills
};

// Dispatch receive: waits for every peer's flags, then out [C, out_row_bytes] gets slot j's
// payload in each row recv_rows[j, :] (>= 0) for j < info[0], and the rows nobody fills
// (row_slot[r] < 0) zeroes (V2Fill). With fp8 (dtype, hidden > 0) the slots hold FP8 wire rows,
// dequantised into rows of dtype.
cudaError_t LaunchV2Permute(const V2Exchange& ex, int64_t k, const int32_t* recv_rows,
                            const int32_t* row_slot, const int32_t* info, const V2Fill& fill,
                            char* out, int64_t out_row_bytes, Dtype fp8_dtype, int64_t fp8_hidden,
                            cudaStream_t stream);

// Redispatch receive (combine's VJP): as the dispatch receive, and with `scale` [C] also
// out_scaled[r] = out[r] * scale[r] in float32 rounded to dtype (0 * scale[r] where nobody
// fills r, as XLA computes it: -0 for negative scales, NaN for infinite ones).
cudaError_t LaunchV2PermuteScaled(const V2Exchange& ex, int64_t k, Dtype dtype,
                                  const int32_t* recv_rows, const int32_t* row_slot,
                                  const int32_t* info, const V2Fill& fill, const float* scale,
                                  char* out, char* out_scaled, cudaStream_t stream);

// Combine, first step (local, no exchange): partials[j] = the float32 sum over ascending k of
// y[recv_rows[j, k]] (times weights[row] when weights is non-null), rounded once to dtype, for
// j < info[0]. y: [C, hidden]; partials: [>= info[0], hidden].
cudaError_t LaunchV2Unpermute(Dtype dtype, int64_t hidden, int64_t k, const char* y,
                              const float* weights, const int32_t* recv_rows, const int32_t* info,
                              int64_t slots, char* partials, cudaStream_t stream);

// Combine receive: waits for every peer's flags, then out[m] = the float32 sum of the partials
// of m's distinct destinations dest[m, :] in ascending rank, rounded once (0 for none).
cudaError_t LaunchV2Reduce(const V2Exchange& ex, Dtype dtype, int64_t k, const int32_t* dest,
                           char* out, cudaStream_t stream);

// ---------------------------------------------------------------------------- attributes

// The kernels' register and shared-memory figures as the loaded module reports them (for the
// benches and the GPU checks; CI reads the same from the compiled module's SASS).
struct V2KernelInfo {
  int registers;
  int64_t static_smem;
  int64_t max_dynamic_smem;
};
cudaError_t V2SendKernelInfo(V2KernelInfo* info);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_V2_TRANSPORT_H_
