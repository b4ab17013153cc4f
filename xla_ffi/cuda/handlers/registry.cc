// The CUDA handlers' registry (registry.h).
#include "xla_ffi/cuda/handlers/registry.h"

#include <vector>

#include "xla_ffi/cuda/state/site_state.h"

namespace jax_hybridep {

std::vector<HandlerEntry> CudaHandlers() {
  std::vector<HandlerEntry> all = CudaLayoutHandlers();
  for (const HandlerEntry& entry : CudaTransportHandlers()) all.push_back(entry);
  return all;
}

std::vector<StateType> CudaStateTypes() { return {SiteStateType()}; }

}  // namespace jax_hybridep
