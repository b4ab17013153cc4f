// The CUDA handlers' registry (cuda_handlers.h).
#include "xla_ffi/cuda/cuda_handlers.h"

#include <vector>

#include "xla_ffi/cuda/site_state.h"

namespace jax_hybridep {

std::vector<HandlerEntry> CudaHandlers() {
  std::vector<HandlerEntry> all = CudaLayoutHandlers();
  for (const HandlerEntry& entry : CudaTransportHandlers()) all.push_back(entry);
  return all;
}

std::vector<StateType> CudaStateTypes() { return {SiteStateType()}; }

}  // namespace jax_hybridep
