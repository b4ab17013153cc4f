// The test module's hooks on the host code: the numeric conversions and FP8 steps the kernels
// use, the transport's limits, and counts of the runtime's process-wide state (host_hooks.cc).
#ifndef JAX_HYBRIDEP_LAB_NATIVE_HOST_HOOKS_H_
#define JAX_HYBRIDEP_LAB_NATIVE_HOST_HOOKS_H_

#include "nanobind/nanobind.h"

namespace jax_hybridep {

// Adds round_trip, fp8_quantize_rows, fp8_quantize_elements, fp8_dequantize_rows, limits,
// record_transport_error, open_exchange_count and call_site_state_count to `m`.
void RegisterHostHooks(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_HOST_HOOKS_H_
