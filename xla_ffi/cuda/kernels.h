// Host-callable launchers of the per-rank CUDA kernels: the device twins of layout.h and
// exchange.h (docs/design.md §2.1, §3).
//
// Framework-free: raw device pointers and a stream, no XLA or nanobind headers, so FFI handlers and
// self-tests share them. Each launcher enqueues its work on `stream` and returns the launch status
// (it never synchronizes). Results are bitwise identical to the host functions of the same name:
// integer steps use the same order, and float sums use explicit round-to-nearest adds in the host's
// order, so they do not depend on FMA contraction (the build also passes --fmad=false).
//
// Every pointer below is device memory (peer memory for the arrays of peer pointers) unless said
// otherwise. Placement, CapacityPlan, ExchangeShape and DispatchRecvBuffer are passed by value;
// their pointers must be device pointers too.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "xla_ffi/exchange.h"
#include "xla_ffi/layout.h"
#include "xla_ffi/numeric.h"

namespace jax_hybridep {

// ---- Layout (layout.h) ----

// CountRows: valid rows per expert of one rank, and its invalid ids (outside [-1, E); -1 ignored).
// topk_idx: [T, K]; counts: [E] (overwritten); invalid: one int64 (overwritten).
cudaError_t LaunchCountRows(const int32_t* topk_idx, int64_t tokens, int64_t k, int64_t num_experts,
                            int32_t* counts, int64_t* invalid, cudaStream_t stream);

// PlanGroups, in one thread block. all_counts: [R, E]; keep_limit, group_offset,
// tokens_per_expert: [E]; group_sizes: [R, num_slots]. As on the host, keep_limit and
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

// DroppedPerSource: rows each source rank loses over capacity. all_counts: [R, E];
// keep_limit: [E]; dropped: [R] int64 (overwritten).
cudaError_t LaunchDroppedPerSource(const int32_t* all_counts, int64_t num_ranks,
                                   int64_t num_experts, const int32_t* keep_limit, int64_t* dropped,
                                   cudaStream_t stream);

// ---- Exchange (exchange.h) ----

// ExpandRows: receive buffer (recv.tokens [R, T, row_bytes], recv.token_ids [R, T],
// recv.row_pos and recv.weights [R, T, K]) into expert-major rows; rows nobody fills are zero.
// out_tokens: [C, row_bytes]; out_weights: [C].
cudaError_t LaunchExpandRows(const ExchangeShape& shape, const DispatchRecvBuffer& recv,
                             char* out_tokens, float* out_weights, cudaStream_t stream);

// WritePartials of destination `rank`: for each received slot with token t of source src, the
// float32 sum over ascending k of y[row] (times weights[row] when weights is non-null), rounded to
// `dtype`, stored at peer_partials[src] + (rank * T + t) * row_bytes. y: [C, H] in `dtype`;
// weights: [C] or null; token_ids: [R, T]; recv_row_pos: [R, T, K]; peer_partials: [R] device
// array of pointers to each source's [R, T, row_bytes] partial buffer.
cudaError_t LaunchWritePartials(const ExchangeShape& shape, int64_t rank, Dtype dtype,
                                const char* y, const float* weights, const int32_t* token_ids,
                                const int32_t* recv_row_pos, char* const* peer_partials,
                                cudaStream_t stream);

// ReducePartials: out[t] = float32 sum of partials[d, t] over the distinct destinations d of
// dest[t, :] in ascending d, rounded once to `dtype`. partials: [R, T, row_bytes]; dest: [T, K];
// out: [T, row_bytes].
cudaError_t LaunchReducePartials(const ExchangeShape& shape, Dtype dtype, const char* partials,
                                 const int32_t* dest, char* out, cudaStream_t stream);

// WriteRowValues: peer_out[src][t * K + k] = values[recv_row_pos[slot, k]] for every received
// slot. values: [C]; token_ids: [R, T]; recv_row_pos: [R, T, K]; peer_out: [R] device array of
// pointers to each source's [T, K] buffer (zeroed by its owner).
cudaError_t LaunchWriteRowValues(const ExchangeShape& shape, const float* values,
                                 const int32_t* token_ids, const int32_t* recv_row_pos,
                                 float* const* peer_out, cudaStream_t stream);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_KERNELS_H_
