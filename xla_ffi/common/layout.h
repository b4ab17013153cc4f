// Layout of one exchange level: which (token, k) gets which row on which rank (docs/design.md
// §2.1).
//
// Framework-free: raw pointers, no XLA or nanobind headers. Every function is deterministic and
// integer-only, so each backend computes the same rows, drops and group sizes.
#ifndef JAX_HYBRIDEP_XLA_FFI_COMMON_LAYOUT_H_
#define JAX_HYBRIDEP_XLA_FFI_COMMON_LAYOUT_H_

#include <cstdint>

namespace jax_hybridep {

// Where each expert lives: expert e is local slot `slot[e]` of EP rank `rank[e]`.
struct Placement {
  const int64_t* rank;  // [num_experts]
  const int64_t* slot;  // [num_experts]
  int64_t num_experts;
  int64_t num_ranks;
  int64_t num_slots;  // local expert slots per rank (E_local)
};

// Static receive-buffer geometry of one rank.
struct CapacityPlan {
  int64_t capacity;      // rows kept per local expert; < 0 means dropless (only `rows` limits)
  int64_t rows;          // C, rows in the expert-major receive buffer
  int64_t pad_multiple;  // every group size is a multiple of this
};

// Counts this rank's valid rows per expert. Ids outside [-1, E) are invalid: counted, not routed.
// counts: [E] (overwritten). Returns the number of invalid ids.
int64_t CountRows(const int32_t* topk_idx, int64_t tokens, int64_t k, int64_t num_experts,
                  int32_t* counts);

// From the all-gathered per-(source rank, expert) counts [R, E], computes for every expert how many
// of its rows are kept and where its group starts on its rank, and every rank's group sizes.
// Experts fill their rank's buffer slot after slot; a group keeps min(rows, capacity, room left
// rounded down to pad_multiple) rows and occupies that count rounded up to pad_multiple.
// Outputs: keep_limit [E], group_offset [E], group_sizes [R, num_slots], tokens_per_expert [E].
void PlanGroups(const int32_t* all_counts, const Placement& placement, const CapacityPlan& plan,
                int32_t* keep_limit, int32_t* group_offset, int32_t* group_sizes,
                int32_t* tokens_per_expert);

// Assigns each (t, k) of source rank `rank` its row in the destination's expert-major buffer, in
// the order (source rank, t, k) within an expert, or -1 when invalid or dropped. row_pos: [T, K].
// Returns the number of valid rows dropped over capacity.
int64_t AssignRows(const int32_t* topk_idx, int64_t tokens, int64_t k, int64_t rank,
                   const int32_t* all_counts, const Placement& placement, const int32_t* keep_limit,
                   const int32_t* group_offset, int32_t* row_pos);

// Rows each source rank loses over capacity, from the same all-gathered counts: every rank can
// tell every other's drops, so strict mode fails on all ranks at once. dropped: [R].
void DroppedPerSource(const int32_t* all_counts, int64_t num_ranks, int64_t num_experts,
                      const int32_t* keep_limit, int64_t* dropped);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_COMMON_LAYOUT_H_
