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
#include "xla_ffi/fp8.h"
#include "xla_ffi/limits.h"
#include "xla_ffi/numeric.h"
#include "xla_ffi/rendezvous.h"

#ifdef JAX_HYBRIDEP_WITH_CUDA
#include "xla_ffi/cuda/bench_bindings.h"
#include "xla_ffi/cuda/bindings.h"
#include "xla_ffi/cuda/cuda_handlers.h"
#include "xla_ffi/cuda/windows.h"
#ifdef JAX_HYBRIDEP_WITH_CUDA_V2
#include "xla_ffi/cuda/v2_bindings.h"
#include "xla_ffi/cuda/v2_handlers.h"
#endif
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

Dtype HostDtype(const std::string& dtype) {
  if (dtype == "float32") return Dtype::kF32;
  if (dtype == "bfloat16") return Dtype::kBF16;
  if (dtype == "float16") return Dtype::kF16;
  throw nb::value_error("dtype must be 'float32', 'bfloat16' or 'float16'");
}

// FP8 wire rows of tokens (raw little-endian bytes, [T, hidden] of dtype), by the host kernels'
// QuantizeRow; tests compare them with jax_hybridep.fp8.quantize bit for bit.
nb::bytes Fp8QuantizeRows(const std::string& dtype, nb::bytes x, int64_t hidden) {
  const Dtype d = HostDtype(dtype);
  const int64_t row = hidden * DtypeBytes(d);
  if (hidden < 1 || x.size() % row != 0) throw nb::value_error("x must be whole rows of hidden");
  const int64_t tokens = static_cast<int64_t>(x.size()) / row;
  std::string out(tokens * Fp8WireBytes(hidden), '\0');
  for (int64_t t = 0; t < tokens; ++t) {
    QuantizeRow(x.c_str() + t * row, hidden, d,
                reinterpret_cast<uint8_t*>(out.data()) + t * Fp8WireBytes(hidden));
  }
  return nb::bytes(out.data(), out.size());
}

// The element step QuantizeE4m3fn(x, inv) over float32 values (raw bytes): tests run it over
// every bfloat16 bit pattern at fixed scales.
nb::bytes Fp8QuantizeElements(nb::bytes values, float inv) {
  const int64_t n = static_cast<int64_t>(values.size() / sizeof(float));
  std::string out(n, '\0');
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<char>(QuantizeE4m3fn(LoadAsFloat(values.c_str(), i, Dtype::kF32), inv));
  }
  return nb::bytes(out.data(), out.size());
}

// The inverse, by DequantizeRow.
nb::bytes Fp8DequantizeRows(const std::string& dtype, nb::bytes wire, int64_t hidden) {
  const Dtype d = HostDtype(dtype);
  const int64_t wire_row = Fp8WireBytes(hidden);
  if (hidden < 1 || wire.size() % wire_row != 0) throw nb::value_error("wire must be whole rows");
  const int64_t tokens = static_cast<int64_t>(wire.size()) / wire_row;
  std::string out(tokens * hidden * DtypeBytes(d), '\0');
  for (int64_t t = 0; t < tokens; ++t) {
    DequantizeRow(reinterpret_cast<const uint8_t*>(wire.c_str()) + t * wire_row, hidden, d,
                  out.data() + t * hidden * DtypeBytes(d));
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
  m.def("fp8_quantize_rows", &jax_hybridep::Fp8QuantizeRows, nb::arg("dtype"), nb::arg("x"),
        nb::arg("hidden"), "FP8 wire rows of tokens (xla_ffi/fp8.h, QuantizeRow).");
  m.def("fp8_quantize_elements", &jax_hybridep::Fp8QuantizeElements, nb::arg("values"),
        nb::arg("inv"), "QuantizeE4m3fn over float32 values (xla_ffi/fp8.h).");
  m.def("fp8_dequantize_rows", &jax_hybridep::Fp8DequantizeRows, nb::arg("dtype"), nb::arg("wire"),
        nb::arg("hidden"), "Tokens from FP8 wire rows (DequantizeRow).");
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
      [] {
        std::vector<jax_hybridep::HandlerEntry> handlers = jax_hybridep::CudaHandlers();
#ifdef JAX_HYBRIDEP_WITH_CUDA_V2
        for (const auto& entry : jax_hybridep::CudaV2Handlers()) handlers.push_back(entry);
#endif
        return jax_hybridep::Registrations(handlers);
      },
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
#ifdef JAX_HYBRIDEP_WITH_CUDA_V2
  m.attr("with_cuda_v2") = true;
  jax_hybridep::RegisterV2Bindings(m);
#else
  m.attr("with_cuda_v2") = false;
#endif
#else
  m.attr("with_cuda") = false;
  m.attr("with_cuda_v2") = false;
#endif
}
