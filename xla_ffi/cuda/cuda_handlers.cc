// The CUDA handlers' registry (cuda_handlers.h).
#include "xla_ffi/cuda/cuda_handlers.h"

#include <vector>

#include "xla_ffi/cuda/site_state.h"

namespace jax_hybridep {

std::vector<HandlerEntry> CudaHandlers() {
  std::vector<HandlerEntry> all = CudaLayoutHandlers();
  for (const HandlerEntry& entry : CudaTransportHandlers()) all.push_back(entry);
#ifdef JAX_HYBRIDEP_WITH_CUDA_V2
  for (const HandlerEntry& entry : CudaV2Handlers()) all.push_back(entry);
#endif
  return all;
}

std::vector<StateType> CudaStateTypes() { return {SiteStateType()}; }

}  // namespace jax_hybridep
