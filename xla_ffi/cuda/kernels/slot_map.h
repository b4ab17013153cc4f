// The transport's slot map (kernels/transport.h): from the routing of every rank of the level,
// all-gathered before the exchange, each rank computes where its items go and what it receives.
// Nothing of it travels with the payload.
//
// Input: gathered [S, M, K, 3] int32, per (source rank s, item m, k): the destination coordinate
// in the level (-1: none), the destination's row (-1 exactly where the coordinate is -1), and the
// routing weight's float32 bits. Item m of s goes to p when any of its k has destination p
// (docs/design.md §2.1.1: one copy per destination). Destination p's receive buffer is dense: its
// slots hold the items it receives in (source, item) order, so source s's items start at base(s, p)
// = the items of sources before s sent to p.
//
// Outputs for rank `rank`:
//   send_slot   [ChunkPadded(M), S]: item m's slot at p, -1 when m does not go to p
//   recv_item   [ChunkPadded(S * M)]: slot j's source and item as s * M + m, -1 past n
//   recv_rows   [ChunkPadded(S * M), K]: slot j's row for each k, -1 for none
//   row_weights [C]: each received row's routing weight, 0 elsewhere
//   row_slot    [C]: the slot feeding each row, -1 for rows nobody fills (padding)
//   info        [2]: n (slots received), last filled row + 1 (0 when none)
// Integer steps only, so the reference (lab/native/cuda/reference.h), the CUDA kernels and the
// numpy twin (tests/transport_twin.py) agree bit for bit.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_SLOT_MAP_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_SLOT_MAP_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "xla_ffi/cuda/kernels/send_plan.h"  // kSendChunk, ChunkPadded

namespace jax_hybridep {

struct SlotMapShape {
  int64_t ranks;  // S
  int64_t items;  // M
  int64_t k;      // K
  int64_t rows;   // C
};

// Device scratch LaunchSlotMap needs.
size_t SlotMapWorkspaceBytes(const SlotMapShape& shape);

// The slot map on the device (slot_map.cu): `rank` is read from device memory (the level
// coordinate operand), so nothing waits for the GPU. workspace: SlotMapWorkspaceBytes(shape).
cudaError_t LaunchSlotMap(const SlotMapShape& shape, const int32_t* rank, const int32_t* gathered,
                          int32_t* send_slot, int32_t* recv_item, int32_t* recv_rows,
                          float* row_weights, int32_t* row_slot, int32_t* info, void* workspace,
                          cudaStream_t stream);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_SLOT_MAP_H_
