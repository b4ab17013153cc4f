// The test module's hooks on the layout step's CUDA kernels: a device count that is 0 (not an
// error) without a driver, and a self-test that runs the kernels on numpy inputs so pytest can
// compare them bitwise with the CPU kernels and the numpy model (layout_hooks.cc). CUDA builds
// only.
#ifndef JAX_HYBRIDEP_LAB_NATIVE_CUDA_LAYOUT_HOOKS_H_
#define JAX_HYBRIDEP_LAB_NATIVE_CUDA_LAYOUT_HOOKS_H_

#include "nanobind/nanobind.h"

namespace jax_hybridep {

// Adds cuda_device_count() and cuda_selftest_layout to `m`.
void RegisterLayoutHooks(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_CUDA_LAYOUT_HOOKS_H_
