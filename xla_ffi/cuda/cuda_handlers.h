// XLA FFI handlers for platform CUDA (cuda_handlers.cc).
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_CUDA_HANDLERS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_CUDA_HANDLERS_H_

#include <vector>

#include "xla_ffi/cpu_handlers.h"

namespace jax_hybridep {

// Every CUDA handler, named jax_hybridep_cuda_<op>.
std::vector<HandlerEntry> CudaHandlers();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_CUDA_HANDLERS_H_
