// Test and benchmark hooks of transport v2 (v2_transport.h) on the test module (_hybridep_testing):
// the send plan and host references (any machine with a CUDA build), the layout kernels and the
// virtual-rank harness (a GPU), and the benches of the GPU checks (scripts/gpu_check.sh).
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_V2_HOOKS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_V2_HOOKS_H_

#include "nanobind/nanobind.h"

namespace jax_hybridep {

// cuda_v2_plan_send, cuda_v2_layout, cuda_v2_reference_* (v2_hooks.cc).
void RegisterCudaV2Hooks(nanobind::module_& m);
// cuda_selftest_v2_transport (v2_harness.cc).
void RegisterCudaV2Harness(nanobind::module_& m);
// cuda_bench_v2, cuda_bench_copy_ceiling, cuda_v2_kernel_info (v2_bench_hooks.cc).
void RegisterCudaV2Bench(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_TESTING_V2_HOOKS_H_
