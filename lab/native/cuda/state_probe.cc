// The per-site state's lifecycle under XLA:CPU (state_probe.h).
#include "lab/native/cuda/state_probe.h"

#include <atomic>
#include <cstdint>
#include <memory>

#include "lab/native/cuda/introspection.h"
#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda/state/site_state.h"

namespace nb = nanobind;

namespace jax_hybridep {
namespace ffi = xla::ffi;
namespace {

// A SiteState with a CPU type id of its own: one TypeId registered on two platforms would be
// assigned by one platform's XLA and reused in the other's registry, where it may collide.
struct ProbeSiteState : SiteState {
  static ffi::TypeId id;
  std::atomic<int32_t> executions{0};
};

ffi::TypeId ProbeSiteState::id = {};
const ffi::TypeInfo kProbeInfo = ffi::MakeTypeInfo<ProbeSiteState>();

ffi::ErrorOr<std::unique_ptr<ProbeSiteState>> Instantiate() {
  return std::make_unique<ProbeSiteState>();
}

// out = [SiteStates alive now, executions of this call site's state so far (this one included)].
ffi::Error Execute(ProbeSiteState* state, ffi::ResultBuffer<ffi::S32> out) {
  if (out->element_count() != 2) return ffi::Error::InvalidArgument("out must be int32[2]");
  out->typed_data()[0] = static_cast<int32_t>(LiveSiteStates());
  out->typed_data()[1] = ++state->executions;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kProbeInstantiate, Instantiate, ffi::Ffi::BindInstantiate());
XLA_FFI_DEFINE_HANDLER(kProbeExecute, Execute,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::State<ProbeSiteState>>()
                           .Ret<ffi::Buffer<ffi::S32>>());  // [live, executions]

StateType ProbeStateType() {
  return {"jax_hybridep_testing_site_state", &ProbeSiteState::id, &kProbeInfo};
}

XLA_FFI_Handler* ProbeInstantiate() { return kProbeInstantiate; }
XLA_FFI_Handler* ProbeExecute() { return kProbeExecute; }

void RegisterStateProbe(nb::module_& m) {
  m.def(
      "live_site_states", [] { return LiveSiteStates(); },
      "Per-site states of the CUDA handlers (and of the CPU probe) alive in this process.");
}

}  // namespace jax_hybridep
