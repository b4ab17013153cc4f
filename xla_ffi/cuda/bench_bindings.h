// The GPU transport's benchmark hook on the native module (bench_bindings.cc).
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_BENCH_BINDINGS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_BENCH_BINDINGS_H_

#include "nanobind/nanobind.h"

namespace jax_hybridep {

// Adds cuda_bench_transport() to `m`.
void RegisterCudaBenchBindings(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_BENCH_BINDINGS_H_
