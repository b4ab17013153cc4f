// The virtual-rank harness of the direct-write transport (test module only): R ranks of one window
// group on one GPU, every exchange one cooperative launch with each rank's blocks resident, running
// the per-rank kernels' device phases (transport_phases.cuh). Framework-free.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_TRANSPORT_HARNESS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_TRANSPORT_HARNESS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "xla_ffi/cuda/transport.h"
#include "xla_ffi/numeric.h"

namespace jax_hybridep {

// Per-rank arrays are [R, ...] concatenations; contexts: device array [R] (rank r's context).

enum class HarnessExchange : int32_t {
  kDispatch = 0,    // x, dest, row_pos, weights -> out_tokens, out_weights, recv_row_pos
  kRedispatch = 1,  // x, dest, recv_row_pos, scale -> out_tokens, out_scaled (prefilled)
  kCombine = 2,     // y, weights, recv_row_pos, dest -> out
  kRowValues = 3,   // values, recv_row_pos, dest -> out_values
};

struct HarnessArgs {
  HarnessExchange exchange;
  Dtype dtype;
  int64_t rows;            // C per rank
  const char* in_rows;     // x [R, T, row_bytes] or y [R, C, row_bytes]
  const int32_t* dest;     // [R, T, K]
  const int32_t* row_pos;  // [R, T, K] (dispatch)
  const float* in_values;  // weights [R, T, K] (dispatch), scale/weights [R, C] or values
  int32_t* recv_row_pos;   // [R, R * T, K]: written by dispatch, read by the others
  char* out_rows;          // [R, C, row_bytes] or [R, T, row_bytes] (combine)
  char* out_scaled;        // [R, C, row_bytes] (redispatch) or null
  float* out_values;       // [R, C] weights (dispatch) or [R, T, K] (row values)
};

// Blocks per rank the harness can keep resident for a given send_blocks (0 when R ranks of that
// many blocks do not fit on the device at once); the receive phases use the same blocks.
cudaError_t HarnessResidentBlocks(int64_t ranks, int* blocks_per_rank);

cudaError_t LaunchHarness(const ExchangeContext* contexts_device, int64_t ranks,
                          int32_t blocks_per_rank, const HarnessArgs& args, cudaStream_t stream);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_TRANSPORT_HARNESS_H_
