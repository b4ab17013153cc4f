// How the send kernel (kernels/send.cu) stages its rows in shared memory: plain C++ arithmetic,
// in every build (the GPU launch uses it, and Python asks the native module for it instead of
// copying it: `send_plan`). No CUDA headers.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_SEND_PLAN_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_SEND_PLAN_H_

#include <cstdint>

#include "xla_ffi/common/numeric.h"  // JAX_HYBRIDEP_CPU_AND_GPU

namespace jax_hybridep {

// Items per send chunk: a chunk's row map loads as one bulk copy (the maps are padded to it).
constexpr int64_t kSendChunk = 64;
// The send block: one G2S warp (loads), kS2GWarps warps storing to the peers.
constexpr int kS2GWarps = 3;
constexpr int kSendThreads = 32 * (1 + kS2GWarps);
constexpr int kSendRegisters = 96;
// Combine sends one partial per (source, item), on at most this many blocks (DispatchConfig's
// num_sms when fewer): 8 SMs at the ~56 GB/s an SM's bulk stores are built for fill an NVLink4
// direction (450 GB/s); the wide unpermute before it runs on every SM.
constexpr int kCombineMaxBlocks = 8;
// Whole-row stages a send block keeps in flight, at most, and the fewest a row may be cut into
// pieces for (rows too large for kMinStages whole stages travel in pieces).
constexpr int kMaxStages = 12;
constexpr int kMinStages = 4;
// A stage goes back to the G2S warp when its S2G warp commits its next row, so the ring must be
// deeper than the S2G warps (or the G2S warp could wait for a stage no warp will release: the
// host executor reports that deadlock, tests/host_executor_planted_test.py).
static_assert(kMinStages > kS2GWarps, "the ring must be deeper than the S2G warps");
// Dynamic shared memory a block may opt into on sm_90 and sm_100 (227 KiB).
constexpr int64_t kSharedBudget = 232448;
// Shared memory a send block uses besides the plan's dynamic bytes (its barriers, and the 1 KiB
// the system reserves per block), with room.
constexpr int64_t kStaticReserve = 2048;

JAX_HYBRIDEP_CPU_AND_GPU inline int64_t ChunkPadded(int64_t n) {
  return (n + kSendChunk - 1) / kSendChunk * kSendChunk;
}

// Byte counts rounded up: bulk copies move 16-byte multiples; the ring of stages starts on a
// 128-byte boundary after the two row-map slots. The plan and the kernel round alike.
JAX_HYBRIDEP_CPU_AND_GPU inline int64_t Round16(int64_t bytes) { return (bytes + 15) / 16 * 16; }
JAX_HYBRIDEP_CPU_AND_GPU inline int64_t Round128(int64_t bytes) {
  return (bytes + 127) / 128 * 128;
}

struct SendPlan {
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
// No plan (stages = 0) when nothing fits `budget`. H = 7168 bf16 gets 12 whole-row stages in
// 172 KiB (tests/cuda_sass_test.py).
SendPlan PlanSend(int64_t staged_bytes, int64_t map_words, int64_t fp8_hidden,
                  int64_t budget = kSharedBudget);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_SEND_PLAN_H_
