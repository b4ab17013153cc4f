// The send kernel's staging plan (send_plan.h).
#include "xla_ffi/cuda/kernels/send_plan.h"

#include <algorithm>
#include <cstdint>

#include "xla_ffi/common/fp8.h"

namespace jax_hybridep {

SendPlan PlanSend(int64_t staged_bytes, int64_t map_words, int64_t fp8_hidden, int64_t budget) {
  SendPlan plan{};
  const int64_t whole = Round16(std::max<int64_t>(staged_bytes, 16));
  plan.map_bytes = kSendChunk * map_words * 4;
  plan.scale_bytes = fp8_hidden > 0 ? Round16(4 * Fp8Blocks(fp8_hidden)) : 0;
  const int64_t fixed = Round128(2 * plan.map_bytes) + kS2GWarps * plan.scale_bytes;
  const int64_t room = budget - fixed - kStaticReserve;
  if (room < 16 * kMinStages) return plan;  // stages = 0: nothing fits
  plan.pieces = 1;
  plan.stage_bytes = whole;
  plan.stages = std::min<int64_t>(kMaxStages, room / whole);
  if (plan.stages < kMinStages) {
    if (fp8_hidden > 0) {  // quantising needs the whole token in one stage: no plan
      plan.stages = 0;
    } else {  // cut rows into pieces of at most room / kMinStages (16-byte multiples)
      plan.stage_bytes = room / kMinStages / 16 * 16;
      plan.pieces = (whole + plan.stage_bytes - 1) / plan.stage_bytes;
      plan.stages = std::min<int64_t>(kMaxStages, room / plan.stage_bytes);
    }
  }
  plan.smem_bytes = fixed + plan.stages * plan.stage_bytes;
  return plan;
}

}  // namespace jax_hybridep
