// The test module's hooks on the code both platforms share (xla_ffi/common/): the numeric
// conversions and FP8 steps the kernels use, the transport's limits, the error log, and counts of
// the runtime's process-wide state (common_hooks.cc).
#ifndef JAX_HYBRIDEP_LAB_NATIVE_COMMON_HOOKS_H_
#define JAX_HYBRIDEP_LAB_NATIVE_COMMON_HOOKS_H_

#include "nanobind/nanobind.h"

namespace jax_hybridep {

// Adds round_trip, fp8_quantize_rows, fp8_quantize_elements, fp8_dequantize_rows, limits,
// record_transport_error, open_exchange_count and call_site_state_count to `m`.
void RegisterCommonHooks(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_COMMON_HOOKS_H_
