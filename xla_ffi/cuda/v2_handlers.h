// XLA FFI handlers of transport v2 for platform CUDA (v2_handlers.cc).
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_V2_HANDLERS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_V2_HANDLERS_H_

#include <vector>

#include "xla_ffi/cpu_handlers.h"

namespace jax_hybridep {

// Every transport v2 handler, named jax_hybridep_cuda_v2_<op>.
std::vector<HandlerEntry> CudaV2Handlers();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_V2_HANDLERS_H_
