// What the CUDA handlers share: a CUDA failure as an XLA FFI error (cleared, so later calls do
// not report it again), and a launch's status as one. Plain C++, built by the C++
// compiler (not nvcc).
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_HANDLERS_SUPPORT_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_HANDLERS_SUPPORT_H_

#include <cuda_runtime_api.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_hybridep {

inline xla::ffi::Error CudaError(cudaError_t status, const char* what) {
  cudaGetLastError();
  return xla::ffi::Error::Internal(std::string("jax_hybridep: ") + what +
                                   " failed: " + cudaGetErrorString(status));
}

inline xla::ffi::Error Launched(cudaError_t status, const char* what) {
  return status == cudaSuccess ? xla::ffi::Error::Success() : CudaError(status, what);
}

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_HANDLERS_SUPPORT_H_
