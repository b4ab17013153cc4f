// The test module's benchmark hook on the GPU transport (bench_hooks.cc). CUDA builds only.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_BENCH_HOOKS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_BENCH_HOOKS_H_

#include "nanobind/nanobind.h"

namespace jax_hybridep {

// Adds cuda_bench_transport() to `m`.
void RegisterCudaBench(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_BENCH_HOOKS_H_
