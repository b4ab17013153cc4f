// The CUDA handlers' per-site state (site_state.h) driven through XLA on the CPU, for tests: a CPU
// handler whose instantiate stage makes a SiteState (of a derived type, so that it has a type id of
// its own on the CPU platform) and whose execute stage reports how many SiteStates are alive, so
// a test can watch XLA create one per call site of an executable and delete it with the
// executable, retrace after retrace, without a GPU (state_probe.cc). CUDA builds only.
#ifndef JAX_HYBRIDEP_LAB_NATIVE_CUDA_STATE_PROBE_H_
#define JAX_HYBRIDEP_LAB_NATIVE_CUDA_STATE_PROBE_H_

#include <vector>

#include "nanobind/nanobind.h"
#include "xla_ffi/cuda/state/site_state.h"

namespace jax_hybridep {

// The probe's state type, for platform cpu.
StateType ProbeStateType();

// The probe's handler: jax_hybridep_testing_site_state, its instantiate and execute stages.
XLA_FFI_Handler* ProbeInstantiate();
XLA_FFI_Handler* ProbeExecute();

// Adds live_site_states() to `m`.
void RegisterStateProbe(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_CUDA_STATE_PROBE_H_
