// Test and benchmark hooks of transport v2 (v2_transport.h) on the native module: the send plan
// and host references (any machine with a CUDA build), the layout kernels and the virtual-rank
// harness (a GPU), and the benches of the GPU checks (scripts/gpu_check.sh).
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_V2_BINDINGS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_V2_BINDINGS_H_

#include "nanobind/nanobind.h"

namespace jax_hybridep {

// cuda_v2_plan_send, cuda_v2_layout, cuda_v2_reference_* (v2_bindings.cc), and the two below.
void RegisterV2Bindings(nanobind::module_& m);
// cuda_selftest_v2_transport (v2_harness.cc).
void RegisterV2HarnessBindings(nanobind::module_& m);
// cuda_bench_v2, cuda_bench_copy_ceiling, cuda_v2_kernel_info (v2_bench_bindings.cc).
void RegisterV2BenchBindings(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_V2_BINDINGS_H_
