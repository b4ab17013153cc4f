#include "xla_ffi/common/layout.h"

#include <algorithm>
#include <vector>

namespace jax_hybridep {

int64_t CountRows(const int32_t* topk_idx, int64_t tokens, int64_t k, int64_t num_experts,
                  int32_t* counts) {
  std::fill(counts, counts + num_experts, 0);
  int64_t invalid = 0;
  for (int64_t i = 0; i < tokens * k; ++i) {
    int32_t e = topk_idx[i];
    if (e >= 0 && e < num_experts) {
      ++counts[e];
    } else if (e != -1) {
      ++invalid;
    }
  }
  return invalid;
}

void PlanGroups(const int32_t* all_counts, const Placement& placement, const CapacityPlan& plan,
                int32_t* keep_limit, int32_t* group_offset, int32_t* group_sizes,
                int32_t* tokens_per_expert) {
  const int64_t num_experts = placement.num_experts;
  const int64_t num_slots = placement.num_slots;
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t total = 0;
    for (int64_t r = 0; r < placement.num_ranks; ++r) total += all_counts[r * num_experts + e];
    tokens_per_expert[e] = static_cast<int32_t>(total);
  }
  // slot_expert[r, s]: the expert in slot s of rank r, or -1 for an empty slot.
  std::vector<int64_t> slot_expert(placement.num_ranks * num_slots, -1);
  for (int64_t e = 0; e < num_experts; ++e) {
    slot_expert[placement.rank[e] * num_slots + placement.slot[e]] = e;
  }
  const int64_t pad = plan.pad_multiple;
  for (int64_t r = 0; r < placement.num_ranks; ++r) {
    int64_t offset = 0;
    for (int64_t s = 0; s < num_slots; ++s) {
      int64_t e = slot_expert[r * num_slots + s];
      int64_t rows = e >= 0 ? tokens_per_expert[e] : 0;
      int64_t room = (plan.rows - offset) / pad * pad;
      int64_t kept = std::min(rows, room);
      if (plan.capacity >= 0) kept = std::min(kept, plan.capacity);
      int64_t size = (kept + pad - 1) / pad * pad;
      group_sizes[r * num_slots + s] = static_cast<int32_t>(size);
      if (e >= 0) {
        keep_limit[e] = static_cast<int32_t>(kept);
        group_offset[e] = static_cast<int32_t>(offset);
      }
      offset += size;
    }
  }
}

int64_t AssignRows(const int32_t* topk_idx, int64_t tokens, int64_t k, int64_t rank,
                   const int32_t* all_counts, const Placement& placement, const int32_t* keep_limit,
                   const int32_t* group_offset, int32_t* row_pos) {
  const int64_t num_experts = placement.num_experts;
  // next_index[e]: index within expert e of this rank's next row = rows from lower source ranks.
  std::vector<int64_t> next_index(num_experts, 0);
  for (int64_t r = 0; r < rank; ++r) {
    for (int64_t e = 0; e < num_experts; ++e) next_index[e] += all_counts[r * num_experts + e];
  }
  int64_t dropped = 0;
  for (int64_t i = 0; i < tokens * k; ++i) {
    int32_t e = topk_idx[i];
    row_pos[i] = -1;
    if (e < 0 || e >= num_experts) continue;
    int64_t index = next_index[e]++;
    if (index < keep_limit[e]) {
      row_pos[i] = static_cast<int32_t>(group_offset[e] + index);
    } else {
      ++dropped;
    }
  }
  return dropped;
}

void DroppedPerSource(const int32_t* all_counts, int64_t num_ranks, int64_t num_experts,
                      const int32_t* keep_limit, int64_t* dropped) {
  std::vector<int64_t> before(num_experts, 0);  // rows of expert e from lower source ranks
  for (int64_t r = 0; r < num_ranks; ++r) {
    dropped[r] = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t count = all_counts[r * num_experts + e];
      const int64_t kept = std::clamp<int64_t>(keep_limit[e] - before[e], 0, count);
      dropped[r] += count - kept;
      before[e] += count;
    }
  }
}

}  // namespace jax_hybridep
