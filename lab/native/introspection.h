// What the tests read of the runtime's process-wide state. Declared here, in the laboratory,
// because only the test module calls them; each is defined in the runtime beside the state it
// reads (xla_ffi/common/rendezvous.cc), whose production header stays free of test-only
// declarations. The CUDA side's: lab/native/cuda/introspection.h.
#ifndef JAX_HYBRIDEP_LAB_NATIVE_INTROSPECTION_H_
#define JAX_HYBRIDEP_LAB_NATIVE_INTROSPECTION_H_

#include <cstdint>

namespace jax_hybridep {

// Number of exchanges waiting for ranks (0 when the process is idle).
int64_t OpenExchangeCount();

// Number of (call site, EP group, rank) generation counters held (a site's counters go once its
// exchanges have completed, so this stays bounded however often a program is retraced).
int64_t CallSiteStateCount();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_INTROSPECTION_H_
