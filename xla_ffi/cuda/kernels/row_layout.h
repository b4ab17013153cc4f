// Launchers of the CUDA layout kernels (C++ calls them; they enqueue the work): the GPU twins of
// layout.h's PlanGroups
// and AssignRows (docs/design.md §2.1.2-3), over the per-(source rank, expert) counts XLA
// all-gathered.
//
// Framework-free: raw device pointers and a stream, no XLA or nanobind headers, so the FFI handler
// and the self-tests share them. Each launcher enqueues its work on `stream` and returns the
// launch status (it never synchronizes). Results are bitwise those of the CPU functions of the
// same name: integer steps in the same order. Every pointer is device memory; Placement and
// CapacityPlan are passed by value and their pointers must be device pointers too.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_ROW_LAYOUT_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_ROW_LAYOUT_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "xla_ffi/common/layout.h"

namespace jax_hybridep {

// PlanGroups, in one thread block. all_counts: [R, E]; keep_limit, group_offset,
// tokens_per_expert: [E]; group_sizes: [R, num_slots]. As on the CPU, keep_limit and
// group_offset of an expert that shares its slot with a higher expert are left untouched.
cudaError_t LaunchPlanGroups(const int32_t* all_counts, const Placement& placement,
                             const CapacityPlan& plan, int32_t* keep_limit, int32_t* group_offset,
                             int32_t* group_sizes, int32_t* tokens_per_expert, cudaStream_t stream);

// Device scratch that LaunchAssignRows needs for these sizes (a per-chunk, per-expert table).
size_t AssignRowsWorkspaceBytes(int64_t tokens, int64_t k, int64_t num_experts);

// AssignRows for source rank `rank`: row_pos [T, K] gets the destination row of each (t, k) in the
// order (source rank, t, k) within an expert, or -1 when invalid or dropped. all_counts: [R, E];
// keep_limit, group_offset: [E] (from PlanGroups); dropped: one int64 (overwritten);
// workspace: AssignRowsWorkspaceBytes(tokens, k, E) bytes.
cudaError_t LaunchAssignRows(const int32_t* topk_idx, int64_t tokens, int64_t k, int64_t rank,
                             const int32_t* all_counts, const Placement& placement,
                             const int32_t* keep_limit, const int32_t* group_offset,
                             int32_t* row_pos, int64_t* dropped, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_ROW_LAYOUT_H_
