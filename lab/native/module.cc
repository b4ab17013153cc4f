// The test module, _hybridep_testing, built beside the production module _hybridep on the same
// runtime library (so it sees the same process-wide state): hooks on the code both platforms
// share, the transport's reference by the CPU kernels, CPU handlers probing the CUDA handlers'
// attribute decoding and, in CUDA builds, the layout kernels' self-test, the transport's
// references, virtual-rank harness and benches (lab/native/cuda/hooks.h) and a CPU probe of the
// CUDA handlers' per-site state. Built only with JAX_HYBRIDEP_TESTING=ON and installed outside the
// package; tests and lab/gpu_transport_bench.py reach it through lab/native_module.py.
#include <vector>

#include "lab/native/attr_probes.h"
#include "lab/native/common_hooks.h"
#include "lab/native/transport_reference.h"
#include "nanobind/nanobind.h"
#include "xla_ffi/cpu/handlers/handlers.h"

#ifdef JAX_HYBRIDEP_WITH_CUDA
#include "lab/native/cuda/hooks.h"
#include "lab/native/cuda/layout_hooks.h"
#include "lab/native/cuda/state_probe.h"
#endif

namespace nb = nanobind;

namespace jax_hybridep {
namespace {

// FFI target name -> handler capsule, or {stage: capsule} for a stateful one.
nb::dict CpuRegistrations() {
  nb::dict out;
  for (const HandlerEntry& entry : AttrProbeHandlers()) {
    out[entry.name] = nb::capsule(reinterpret_cast<void*>(entry.handler));
  }
#ifdef JAX_HYBRIDEP_WITH_CUDA
  nb::dict stages;
  stages["instantiate"] = nb::capsule(reinterpret_cast<void*>(ProbeInstantiate()));
  stages["execute"] = nb::capsule(reinterpret_cast<void*>(ProbeExecute()));
  out["jax_hybridep_testing_site_state"] = stages;
#endif
  return out;
}

// FFI type name -> {"type_id", "type_info"} capsules.
nb::dict CpuStateTypeRegistrations() {
  nb::dict out;
#ifdef JAX_HYBRIDEP_WITH_CUDA
  const StateType probe = ProbeStateType();
  nb::dict registration;
  registration["type_id"] = nb::capsule(reinterpret_cast<void*>(probe.id));
  registration["type_info"] =
      nb::capsule(reinterpret_cast<void*>(const_cast<xla::ffi::TypeInfo*>(probe.info)));
  out[probe.name] = registration;
#endif
  return out;
}

}  // namespace
}  // namespace jax_hybridep

NB_MODULE(_hybridep_testing, m) {
  m.doc() = "jax_hybridep's test hooks (self-tests, harness, benchmarks, introspection)";
  m.def("cpu_registrations", &jax_hybridep::CpuRegistrations,
        "The test module's FFI target name -> handler capsule (or {stage: capsule}), for "
        "platform 'cpu'.");
  m.def("cpu_state_type_registrations", &jax_hybridep::CpuStateTypeRegistrations,
        "The test module's FFI type name -> {'type_id', 'type_info'} capsules, for platform "
        "'cpu' (registered before the handlers).");
  jax_hybridep::RegisterCommonHooks(m);
  jax_hybridep::RegisterTransportReference(m);
#ifdef JAX_HYBRIDEP_WITH_CUDA
  m.attr("with_cuda") = true;
  jax_hybridep::RegisterLayoutHooks(m);
  jax_hybridep::RegisterStateProbe(m);
  jax_hybridep::RegisterTransportHooks(m);
  jax_hybridep::RegisterTransportHarness(m);
  jax_hybridep::RegisterTransportBench(m);
#else
  m.attr("with_cuda") = false;
#endif
}
