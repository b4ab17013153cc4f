// Transport v2's layout (v2_transport.h): from the routing of every rank of the level, all-gathered
// before the exchange, each rank computes where its items go and what it receives. Nothing of
// it travels with the payload (transport v1 stored R x K scalars per token into every peer).
//
// Input: gathered [S, M, K, 3] int32, per (source rank s, item m, k): the destination coordinate
// in the level (-1: none), the destination's row (-1 exactly where the coordinate is -1), and the
// routing weight's float32 bits. Item m of s goes to p when any of its k has destination p
// (docs/design.md §2.1.1: one copy per destination). Destination p's receive buffer is dense: its
// slots hold the items it receives in (source, item) order, so source s's items start at base(s, p)
// = the items of sources before s sent to p.
//
// Outputs for rank `rank`:
//   send_slot   [round_up(M, kV2Chunk), S]: item m's slot at p, -1 when m does not go to p
//   recv_item   [round_up(S * M, kV2Chunk)]: slot j's source and item as s * M + m, -1 past n
//   recv_rows   [round_up(S * M, kV2Chunk), K]: slot j's row for each k, -1 for none
//   row_weights [C]: each received row's routing weight, 0 elsewhere
//   row_slot    [C]: the slot feeding each row, -1 for rows nobody fills (padding)
//   info        [2]: n (slots received), last filled row + 1 (0 when none)
// Integer steps only, so the host reference here, the CUDA kernels and the numpy twin
// (tests/transport_v2_twin.py) agree bit for bit.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_V2_LAYOUT_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_V2_LAYOUT_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "xla_ffi/numeric.h"  // JAX_HYBRIDEP_HOST_DEVICE

namespace jax_hybridep {

// Items per send chunk (and the padding of the maps, so a chunk's map loads as one bulk copy).
constexpr int64_t kV2Chunk = 64;

JAX_HYBRIDEP_HOST_DEVICE inline int64_t V2Padded(int64_t n) {
  return (n + kV2Chunk - 1) / kV2Chunk * kV2Chunk;
}

struct V2LayoutShape {
  int64_t ranks;  // S
  int64_t items;  // M
  int64_t k;      // K
  int64_t rows;   // C
};

// Host reference of the layout (v2_reference.cc; the CUDA kernels compute the same).
void V2LayoutHost(const V2LayoutShape& shape, int32_t rank, const int32_t* gathered,
                  int32_t* send_slot, int32_t* recv_item, int32_t* recv_rows, float* row_weights,
                  int32_t* row_slot, int32_t* info);

// Device scratch LaunchV2Layout needs.
size_t V2LayoutWorkspaceBytes(const V2LayoutShape& shape);

// The layout on the device (v2_layout.cu): `rank` is read from device memory (the level
// coordinate operand), so there is no host sync. workspace: V2LayoutWorkspaceBytes(shape).
cudaError_t LaunchV2Layout(const V2LayoutShape& shape, const int32_t* rank, const int32_t* gathered,
                           int32_t* send_slot, int32_t* recv_item, int32_t* recv_rows,
                           float* row_weights, int32_t* row_slot, int32_t* info, void* workspace,
                           cudaStream_t stream);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_V2_LAYOUT_H_
