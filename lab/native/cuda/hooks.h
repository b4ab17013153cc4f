// Test and benchmark hooks of the transport (kernels/transport.h) on the test module
// (_hybridep_testing) and the host executor's module: host references (any machine with a CUDA
// build), the slot-map kernels and the virtual-rank harness (a GPU or the executor), and the
// benches of the GPU checks (scripts/gpu_check.sh).
#ifndef JAX_HYBRIDEP_LAB_NATIVE_CUDA_HOOKS_H_
#define JAX_HYBRIDEP_LAB_NATIVE_CUDA_HOOKS_H_

#include "nanobind/nanobind.h"

namespace jax_hybridep {

// cuda_slot_map, cuda_reference_* (hooks.cc).
void RegisterTransportHooks(nanobind::module_& m);
// cuda_selftest_transport (harness.cc).
void RegisterTransportHarness(nanobind::module_& m);
// cuda_bench_transport, cuda_bench_copy_ceiling, cuda_send_kernel_info (bench_hooks.cc).
void RegisterTransportBench(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_CUDA_HOOKS_H_
