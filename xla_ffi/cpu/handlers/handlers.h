// The host handlers (XLA FFI handlers for XLA's Host platform, the CPU), by target name.
#ifndef JAX_HYBRIDEP_XLA_FFI_CPU_HANDLERS_HANDLERS_H_
#define JAX_HYBRIDEP_XLA_FFI_CPU_HANDLERS_HANDLERS_H_

#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jax_hybridep {

struct HandlerEntry {
  const char* name;  // FFI target name, jax_hybridep_<op>
  XLA_FFI_Handler* handler;
};

// Every host handler: the one-level ones (handlers.cc) and the per-level steps of multi-level
// topologies (level_handlers.cc).
std::vector<HandlerEntry> CpuHandlers();
std::vector<HandlerEntry> CpuLevelHandlers();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CPU_HANDLERS_HANDLERS_H_
