// The one native module, _hybridep: FFI handler capsules for registration at import, and a few
// introspection hooks for tests.
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla_ffi/cpu_handlers.h"
#include "xla_ffi/error_log.h"
#include "xla_ffi/limits.h"
#include "xla_ffi/numeric.h"
#include "xla_ffi/rendezvous.h"

#ifdef JAX_HYBRIDEP_WITH_CUDA
#include "xla_ffi/cuda/bench_bindings.h"
#include "xla_ffi/cuda/bindings.h"
#include "xla_ffi/cuda/cuda_handlers.h"
#include "xla_ffi/cuda/windows.h"
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

// Rounds float32 values (given as raw little-endian bytes) to bfloat16 or float16 and back, with
// the conversions the kernels use; tests compare them with numpy's.
nb::bytes RoundTrip(const std::string& dtype, nb::bytes values) {
  const Dtype target = dtype == "bfloat16" ? Dtype::kBF16 : Dtype::kF16;
  if (dtype != "bfloat16" && dtype != "float16") {
    throw nb::value_error("dtype must be 'bfloat16' or 'float16'");
  }
  std::string out(values.size(), '\0');
  const int64_t n = static_cast<int64_t>(values.size() / sizeof(float));
  for (int64_t i = 0; i < n; ++i) {
    uint16_t half;
    StoreFromFloat(&half, 0, LoadAsFloat(values.c_str(), i, Dtype::kF32), target);
    StoreFromFloat(out.data(), i, LoadAsFloat(&half, 0, target), Dtype::kF32);
  }
  return nb::bytes(out.data(), out.size());
}

#ifdef JAX_HYBRIDEP_WITH_CUDA
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
  m.doc() = "jax_hybridep native kernels and XLA FFI handlers";
  m.def(
      "cpu_registrations", [] { return jax_hybridep::Registrations(jax_hybridep::CpuHandlers()); },
      "FFI target name -> handler capsule, for platform 'cpu'.");
  m.def("open_exchange_count", &jax_hybridep::OpenExchangeCount,
        "Exchanges waiting for ranks in this process (0 when idle).");
  m.def("call_site_state_count", &jax_hybridep::CallSiteStateCount,
        "Per-(call site, EP group, rank) generation counters held in this process (0 when idle).");
  m.def("round_trip", &jax_hybridep::RoundTrip, nb::arg("dtype"), nb::arg("values"));
  m.def(
      "limits",
      [] {
        nb::dict out;
        out["max_send_blocks"] = jax_hybridep::kMaxSendBlocks;
        out["max_top_k"] = jax_hybridep::kMaxTopK;
        return out;
      },
      "The transport's limits that the Python side mirrors (xla_ffi/limits.h).");
  m.def(
      "take_recorded_errors",
      [] {
        nb::list out;
        for (const auto& [kind, message] : jax_hybridep::TakeRecordedErrors()) {
          out.append(nb::make_tuple(
              kind == jax_hybridep::ErrorKind::kStrictMode ? "strict_mode" : "transport", message));
        }
        return out;
      },
      "Handler failures recorded since the last call, oldest first: [(kind, message)] with kind "
      "'strict_mode' or 'transport'; the log is empty afterwards.");
#ifdef JAX_HYBRIDEP_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def(
      "cuda_registrations",
      [] { return jax_hybridep::Registrations(jax_hybridep::CudaHandlers()); },
      "FFI target name -> handler capsule, for platform 'CUDA'.");
  m.def("cuda_window_error", &jax_hybridep::FirstWindowError,
        "The first device-side error recorded in any exchange window ('' when none).");
  m.def("set_kv_exchange", &jax_hybridep::SetPythonKvExchange, nb::arg("fn"),
        "Sets fn(prefix, rank, mine, count, timeout_ms) -> list[bytes], the key-value exchange "
        "of GPU window handles between processes.");
  m.def("release_cuda_windows", &jax_hybridep::ReleaseWindows,
        "Frees every registered exchange window (called at exit).");
  jax_hybridep::RegisterCudaBindings(m);
  jax_hybridep::RegisterCudaBenchBindings(m);
#else
  m.attr("with_cuda") = false;
#endif
}
