// What the files of the device primitives share (collectives.cc, atomics.cc, bulk_copies.cc):
// the calling kernel thread, and an acquire of what two clocks carry. Not for kernel code.
#ifndef JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PRIMITIVES_H_
#define JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PRIMITIVES_H_

#include <stdexcept>
#include <string>

#include "lab/host_executor/scheduler.h"

namespace jax_hybridep::host {

// The kernel thread running `what` (a primitive called outside one is the executor's bug).
inline Thread* Self(const char* what) {
  Thread* t = g_thread;
  if (t == nullptr) {
    throw std::logic_error(std::string("host executor: ") + what + " outside a kernel thread");
  }
  return t;
}

// Acquire: `k` learns what the clocks carry.
inline void Acquire(Knowledge& k, const ClockRef& clock, const ClockRef& async) {
  k.known = Join(k.known, clock);
  k.async_known = Join(k.async_known, async);
}

}  // namespace jax_hybridep::host

#endif  // JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PRIMITIVES_H_
