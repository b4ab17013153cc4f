// The test module, _hybridep_testing, built beside the production module _hybridep on the same
// runtime library (so it sees the same process-wide state): hooks on the host kernels, the
// transport's host reference, CPU handlers probing the CUDA handlers' attribute decoding and, in
// CUDA builds, the kernels' self-tests, the virtual-rank harness and the transport benchmark.
// Tests and jax_hybridep.bench.gpu_transport use it (jax_hybridep._native.testing_module()).
#include <vector>

#include "nanobind/nanobind.h"
#include "xla_ffi/cpu_handlers.h"
#include "xla_ffi/testing/attr_probes.h"
#include "xla_ffi/testing/host_hooks.h"
#include "xla_ffi/testing/transport_reference.h"

#ifdef JAX_HYBRIDEP_WITH_CUDA
#include "xla_ffi/cuda/testing/bench_hooks.h"
#include "xla_ffi/cuda/testing/selftest_hooks.h"
#endif

namespace nb = nanobind;

NB_MODULE(_hybridep_testing, m) {
  m.doc() = "jax_hybridep's test hooks (self-tests, harness, benchmarks, introspection)";
  m.def(
      "cpu_registrations",
      [] {
        nb::dict out;
        for (const jax_hybridep::HandlerEntry& entry : jax_hybridep::AttrProbeHandlers()) {
          out[entry.name] = nb::capsule(reinterpret_cast<void*>(entry.handler));
        }
        return out;
      },
      "The test module's FFI target name -> handler capsule, for platform 'cpu'.");
  jax_hybridep::RegisterHostHooks(m);
  jax_hybridep::RegisterTransportReference(m);
#ifdef JAX_HYBRIDEP_WITH_CUDA
  m.attr("with_cuda") = true;
  jax_hybridep::RegisterCudaSelftests(m);
  jax_hybridep::RegisterCudaBench(m);
#else
  m.attr("with_cuda") = false;
#endif
}
