// CPU handlers decoding the CUDA handlers' attribute structs, for tests (attr_probes.cc).
#ifndef JAX_HYBRIDEP_LAB_NATIVE_ATTR_PROBES_H_
#define JAX_HYBRIDEP_LAB_NATIVE_ATTR_PROBES_H_

#include <vector>

#include "xla_ffi/cpu/handlers/handlers.h"

namespace jax_hybridep {

// jax_hybridep_testing_decode_<bundle>, for platform cpu.
std::vector<HandlerEntry> AttrProbeHandlers();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_ATTR_PROBES_H_
