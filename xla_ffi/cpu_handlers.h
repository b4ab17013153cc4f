// The host (CPU) XLA FFI handlers, by target name.
#ifndef JAX_HYBRIDEP_XLA_FFI_CPU_HANDLERS_H_
#define JAX_HYBRIDEP_XLA_FFI_CPU_HANDLERS_H_

#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jax_hybridep {

struct HandlerEntry {
  const char* name;  // FFI target name, jax_hybridep_<op>
  XLA_FFI_Handler* handler;
};

std::vector<HandlerEntry> CpuHandlers();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CPU_HANDLERS_H_
