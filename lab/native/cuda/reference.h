// References of the transport's slot map (kernels/slot_map.h) and row steps (kernels/transport.h),
// element for element in the kernels' order, so tests compare the CUDA kernels and the numpy twin
// (tests/transport_twin.py) with them bit for bit. Plain C++ (reference.cc).
#ifndef JAX_HYBRIDEP_LAB_NATIVE_CUDA_REFERENCE_H_
#define JAX_HYBRIDEP_LAB_NATIVE_CUDA_REFERENCE_H_

#include <cstdint>

#include "xla_ffi/common/numeric.h"
#include "xla_ffi/cuda/kernels/slot_map.h"

namespace jax_hybridep {

// The slot map (kernels/slot_map.h): send_slot, recv_item, recv_rows, row_weights, row_slot and
// info as LaunchSlotMap computes them, for this `rank`, step for step in integers.
void SlotMapReference(const SlotMapShape& shape, int32_t rank, const int32_t* gathered,
                      int32_t* send_slot, int32_t* recv_item, int32_t* recv_rows,
                      float* row_weights, int32_t* row_slot, int32_t* info);

// Permute: out [C, ...] from the receive buffer [n, slot_stride]: slot j's row_bytes copied into
// its rows (or, with fp8_hidden = H > 0, its FP8 wire row dequantised into rows of dtype),
// then the rows nobody fills below the zero line zeroed (LaunchPermute's PaddingFill). With `scale`
// [C], also out_scaled [C, ...] = out * scale in float32 rounded to dtype (the rows'
// dtype),
// 0 * scale for rows nobody fills (LaunchPermuteScaled).
void PermuteReference(const SlotMapShape& shape, const char* slots, int64_t slot_stride,
                      int64_t row_bytes, const int32_t* recv_rows, const int32_t* row_slot,
                      const int32_t* info, int64_t zero_pad_multiple, char* out, Dtype dtype,
                      int64_t fp8_hidden, const float* scale, char* out_scaled);
// Unpermute: partials [n, hidden] of dtype (see LaunchUnpermute).
void UnpermuteReference(const SlotMapShape& shape, Dtype dtype, int64_t hidden, const char* y,
                        const float* weights, const int32_t* recv_rows, const int32_t* info,
                        char* partials);
// Reduce: out [M, hidden] from the partials [S * M, hidden] at slot d * M + m.
void ReduceReference(const SlotMapShape& shape, Dtype dtype, int64_t hidden, const char* partials,
                     const int32_t* dest, char* out);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_CUDA_REFERENCE_H_
