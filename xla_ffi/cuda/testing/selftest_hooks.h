// The test module's hooks on the CUDA kernels: a device count that is 0 (not an error) without a
// driver, and self-tests that run the kernels on host inputs so pytest can compare them bitwise
// with the host kernels and the numpy model (selftest_hooks.cc). CUDA builds only.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_SELFTEST_HOOKS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_SELFTEST_HOOKS_H_

#include "nanobind/nanobind.h"

namespace jax_hybridep {

// Adds cuda_device_count() and the cuda_selftest_* functions to `m`.
void RegisterCudaSelftests(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_SELFTEST_HOOKS_H_
