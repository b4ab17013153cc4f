// The XLA FFI handlers for platform CUDA, by target name, and what registering them needs: the
// instantiate stage they share (a per-site state the executable owns, state/site_state.h) and
// that state's type.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_HANDLERS_REGISTRY_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_HANDLERS_REGISTRY_H_

#include <vector>

#include "xla_ffi/cpu/handlers/handlers.h"
#include "xla_ffi/cuda/state/site_state.h"

namespace jax_hybridep {

// jax_hybridep_cuda_layout (layout.cc).
std::vector<HandlerEntry> CudaLayoutHandlers();
// The transport's slot map and exchanges, jax_hybridep_cuda_<op> (transport.cc).
std::vector<HandlerEntry> CudaTransportHandlers();

// Every CUDA handler's execute stage; each binds SiteStateInstantiate() as its instantiate stage.
std::vector<HandlerEntry> CudaHandlers();

// The state types the CUDA handlers use, registered with XLA before them.
std::vector<StateType> CudaStateTypes();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_HANDLERS_REGISTRY_H_
