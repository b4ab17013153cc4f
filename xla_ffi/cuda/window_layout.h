// One rank's registered window of the direct-write transport (transport.h): its geometry, its
// regions (two halves of payload and metadata, the arrival flags, the error claim) and their
// offsets. Plain C++ shared by the host (allocation, windows.cc) and the device (RowStride).
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_WINDOW_LAYOUT_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_WINDOW_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#include "xla_ffi/limits.h"   // kMaxWindowRanks, kMaxSendBlocks
#include "xla_ffi/numeric.h"  // JAX_HYBRIDEP_HOST_DEVICE

namespace jax_hybridep {

// Geometry a window is sized for.
struct WindowGeometry {
  int64_t ranks;      // R
  int64_t tokens;     // T per source rank
  int64_t k;          // K routing slots per token
  int64_t row_bytes;  // the widest row this window carries (H * element size)
};

// Bytes of one rank's window, and its regions at their offsets (all 256-byte aligned).
size_t WindowBytes(const WindowGeometry& geometry);

// One rank's window as any rank of the group addresses it (peer pointers on other devices).
struct Window {
  char* payload[2];       // [R, T, row_stride]: token rows (dispatch) or partial sums (combine)
  int32_t* row_pos[2];    // [R, T, K]: the receiver's row per (source, t, k), -1 when none
  float* values[2];       // [R, T, K]: routing weights (dispatch) or returned row values
  uint64_t* arrived;      // [R, kMaxSendBlocks]: generation each source block last completed
  uint32_t* error_claim;  // [1]: set by the first of this rank's waits to fail
};

// Carves a window's regions out of `base` (WindowBytes(geometry) bytes, 256-byte aligned).
Window CarveWindow(char* base, const WindowGeometry& geometry);

// Stride of a row slot in the payload (row_bytes rounded up to 16 bytes).
JAX_HYBRIDEP_HOST_DEVICE inline int64_t RowStride(int64_t row_bytes) {
  return (row_bytes + 15) / 16 * 16;
}

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_WINDOW_LAYOUT_H_
