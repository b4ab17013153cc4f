// The production native module, _hybridep: the FFI handlers' capsules for registration at import,
// and the few runtime services the package's Python needs (with_cuda; the failures the handlers
// recorded, for hep.check_errors(); the GPU transport's limits and send plan, which Python asks
// for instead of copying them; for the CUDA transport, the key-value exchange of window handles
// between processes and the release of the windows at exit). The CUDA handlers come with their
// state type (the per-site state each executable owns, xla_ffi/cuda/state/site_state.h).
// Self-tests, the virtual-rank harness, benchmark hooks and introspection live in the test module
// built beside it (lab/native/module.cc); both run on the one runtime library.
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla_ffi/common/error_log.h"
#include "xla_ffi/common/limits.h"
#include "xla_ffi/cpu/handlers/handlers.h"
#include "xla_ffi/cuda/kernels/send_plan.h"

#ifdef JAX_HYBRIDEP_WITH_CUDA
#include "xla_ffi/cuda/handlers/registry.h"
#include "xla_ffi/cuda/state/window_registry.h"
#endif

namespace nb = nanobind;

namespace jax_hybridep {
namespace {

nb::dict Registrations(const std::vector<HandlerEntry>& handlers) {
  nb::dict out;
  for (const HandlerEntry& entry : handlers) {
    out[entry.name] = nb::capsule(reinterpret_cast<void*>(entry.handler));
  }
  return out;
}

nb::list TakeErrors() {
  nb::list out;
  for (const auto& [kind, message] : TakeRecordedErrors()) {
    out.append(
        nb::make_tuple(kind == ErrorKind::kStrictMode ? "strict_mode" : "transport", message));
  }
  return out;
}

nb::dict Limits() {
  nb::dict out;
  out["max_send_blocks"] = kMaxSendBlocks;
  out["max_top_k"] = kMaxTopK;
  out["max_window_ranks"] = kMaxWindowRanks;
  out["send_chunk"] = kSendChunk;
  out["shared_budget"] = kSharedBudget;
  return out;
}

nb::dict SendPlanOf(int64_t staged_bytes, int64_t map_words, int64_t fp8_hidden, int64_t budget) {
  if (staged_bytes <= 0 || map_words <= 0 || fp8_hidden < 0 || budget <= 0) {
    throw nb::value_error(
        "send_plan: need staged_bytes, map_words, budget > 0 and fp8_hidden >= 0");
  }
  const SendPlan p = PlanSend(staged_bytes, map_words, fp8_hidden, budget);
  nb::dict out;
  out["stage_bytes"] = p.stage_bytes;
  out["pieces"] = p.pieces;
  out["stages"] = p.stages;
  out["map_bytes"] = p.map_bytes;
  out["scale_bytes"] = p.scale_bytes;
  out["smem_bytes"] = p.smem_bytes;
  out["threads"] = kSendThreads;
  out["s2g_warps"] = kS2GWarps;
  return out;
}

#ifdef JAX_HYBRIDEP_WITH_CUDA
// Every CUDA handler with its stages: the shared instantiate (the executable's per-site state) and
// its own execute.
nb::dict CudaRegistrations() {
  nb::dict out;
  for (const HandlerEntry& entry : CudaHandlers()) {
    nb::dict stages;
    stages["instantiate"] = nb::capsule(reinterpret_cast<void*>(SiteStateInstantiate()));
    stages["execute"] = nb::capsule(reinterpret_cast<void*>(entry.handler));
    out[entry.name] = stages;
  }
  return out;
}

nb::dict StateTypeRegistrations(const std::vector<StateType>& types) {
  nb::dict out;
  for (const StateType& type : types) {
    nb::dict registration;
    registration["type_id"] = nb::capsule(reinterpret_cast<void*>(type.id));
    registration["type_info"] =
        nb::capsule(reinterpret_cast<void*>(const_cast<xla::ffi::TypeInfo*>(type.info)));
    out[type.name] = registration;
  }
  return out;
}

// Routes the multi-process windows' key-value exchange to a Python callable
// fn(prefix, rank, mine: bytes, count, timeout_ms) -> list[bytes]; it runs on XLA's threads,
// holding the GIL while it runs.
void SetPythonKvExchange(nb::callable fn) {
  // Kept for the life of the process: releasing a Python object at exit needs a live interpreter.
  auto* held = new nb::callable(std::move(fn));
  SetKvExchange([held](const std::string& prefix, int32_t rank, const std::string& mine,
                       int64_t count, int64_t timeout_ms, std::vector<std::string>* all) {
    nb::gil_scoped_acquire gil;
    try {
      nb::object values =
          (*held)(prefix, rank, nb::bytes(mine.data(), mine.size()), count, timeout_ms);
      all->clear();
      for (nb::handle value : values) {
        nb::bytes b = nb::cast<nb::bytes>(value);
        all->emplace_back(b.c_str(), b.size());
      }
      return Status::Ok();
    } catch (const std::exception& e) {
      return Status{Status::Code::kDeadlineExceeded,
                    std::string("jax_hybridep: exchanging GPU window handles: ") + e.what()};
    }
  });
}
#endif

}  // namespace
}  // namespace jax_hybridep

NB_MODULE(_hybridep, m) {
  m.doc() = "jax_hybridep's XLA FFI handlers (registered by jax_hybridep._native at import)";
  m.def(
      "cpu_registrations", [] { return jax_hybridep::Registrations(jax_hybridep::CpuHandlers()); },
      "FFI target name -> handler capsule, for platform 'cpu'.");
  m.def(
      "limits", &jax_hybridep::Limits,
      "The GPU transport's limits (xla_ffi/common/limits.h, kernels/send_plan.h): max_send_blocks, "
      "max_top_k, max_window_ranks, send_chunk (items per send chunk), shared_budget.");
  m.def("send_plan", &jax_hybridep::SendPlanOf, nb::arg("staged_bytes"), nb::arg("map_words"),
        nb::arg("fp8_hidden") = 0, nb::arg("budget") = jax_hybridep::kSharedBudget,
        "How the send kernel stages rows of staged_bytes (kernels/send_plan.h PlanSend): stages "
        "(0: nothing fits), pieces per row, stage, map and shared-memory bytes, threads.");
  m.def("take_recorded_errors", &jax_hybridep::TakeErrors,
        "Handler failures recorded since the last call, oldest first: [(kind, message)] with kind "
        "'strict_mode' or 'transport'; the log is empty afterwards.");
#ifdef JAX_HYBRIDEP_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("cuda_registrations", &jax_hybridep::CudaRegistrations,
        "FFI target name -> {'instantiate', 'execute'} handler capsules, for platform 'CUDA'.");
  m.def(
      "cuda_state_type_registrations",
      [] { return jax_hybridep::StateTypeRegistrations(jax_hybridep::CudaStateTypes()); },
      "FFI type name -> {'type_id', 'type_info'} capsules of the CUDA handlers' state, for "
      "platform 'CUDA' (registered before the handlers).");
  m.def("cuda_window_error", &jax_hybridep::FirstWindowError,
        "The first device-side error recorded in any exchange window ('' when none).");
  m.def("set_kv_exchange", &jax_hybridep::SetPythonKvExchange, nb::arg("fn"),
        "Sets fn(prefix, rank, mine, count, timeout_ms) -> list[bytes], the key-value exchange "
        "of GPU window handles between processes.");
  m.def("release_cuda_windows", &jax_hybridep::ReleaseWindows,
        "Frees every registered exchange window (called at exit).");
#else
  m.attr("with_cuda") = false;
#endif
}
