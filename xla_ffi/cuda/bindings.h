// Python hooks of the CUDA kernels on the native module: a device count that is 0 (not an error)
// without a driver, and self-tests that run each kernel on host inputs so pytest can compare it
// bitwise with the host kernels. Compiled only when the module is built with CUDA.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_BINDINGS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_BINDINGS_H_

#include "nanobind/nanobind.h"

namespace jax_hybridep {

// Adds cuda_device_count() and the cuda_selftest_* functions to `m`.
void RegisterCudaBindings(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_BINDINGS_H_
