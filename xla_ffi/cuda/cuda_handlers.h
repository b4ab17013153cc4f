// The XLA FFI handlers for platform CUDA, by target name, and what registering them needs: the
// instantiate stage they share (a per-site state the executable owns, site_state.h) and that
// state's type. A transport adds its list here and to CudaHandlers().
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_CUDA_HANDLERS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_CUDA_HANDLERS_H_

#include <vector>

#include "xla_ffi/cpu_handlers.h"
#include "xla_ffi/cuda/site_state.h"

namespace jax_hybridep {

// jax_hybridep_cuda_layout (layout_handlers.cc).
std::vector<HandlerEntry> CudaLayoutHandlers();
// The direct-write transport's exchanges, jax_hybridep_cuda_<op> (transport_handlers.cc).
std::vector<HandlerEntry> CudaTransportHandlers();
// Transport v2's layout and exchanges, jax_hybridep_cuda_v2_<op> (v2_handlers.cc; built unless
// CMake's JAX_HYBRIDEP_CUDA_V2 is OFF).
std::vector<HandlerEntry> CudaV2Handlers();

// Every CUDA handler's execute stage; each binds SiteStateInstantiate() as its instantiate stage.
std::vector<HandlerEntry> CudaHandlers();

// The state types the CUDA handlers use, registered with XLA before them.
std::vector<StateType> CudaStateTypes();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_CUDA_HANDLERS_H_
