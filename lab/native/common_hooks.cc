// Hooks on xla_ffi/common/ for tests (common_hooks.h): values go in and out as raw little-endian
// bytes, so tests compare them with numpy's and jax_hybridep.fp8's bit for bit.
#include "lab/native/common_hooks.h"

#include <cstdint>
#include <string>

#include "lab/native/introspection.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla_ffi/common/error_log.h"
#include "xla_ffi/common/fp8.h"
#include "xla_ffi/common/limits.h"
#include "xla_ffi/common/numeric.h"

namespace nb = nanobind;

namespace jax_hybridep {
namespace {

// Rounds float32 values to bfloat16 or float16 and back, with the conversions the kernels use.
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

Dtype RowDtype(const std::string& dtype) {
  if (dtype == "float32") return Dtype::kF32;
  if (dtype == "bfloat16") return Dtype::kBF16;
  if (dtype == "float16") return Dtype::kF16;
  throw nb::value_error("dtype must be 'float32', 'bfloat16' or 'float16'");
}

// FP8 wire rows of tokens ([T, hidden] of dtype), by the CPU kernels' QuantizeRow.
nb::bytes Fp8QuantizeRows(const std::string& dtype, nb::bytes x, int64_t hidden) {
  const Dtype d = RowDtype(dtype);
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

// The element step QuantizeE4m3fn(x, inv) over float32 values: tests run it over every bfloat16
// bit pattern at fixed scales.
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
  const Dtype d = RowDtype(dtype);
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

}  // namespace

void RegisterCommonHooks(nb::module_& m) {
  m.def("round_trip", &RoundTrip, nb::arg("dtype"), nb::arg("values"),
        "float32 values rounded to `dtype` and back by numeric.h's conversions.");
  m.def("fp8_quantize_rows", &Fp8QuantizeRows, nb::arg("dtype"), nb::arg("x"), nb::arg("hidden"),
        "FP8 wire rows of tokens (xla_ffi/common/fp8.h, QuantizeRow).");
  m.def("fp8_quantize_elements", &Fp8QuantizeElements, nb::arg("values"), nb::arg("inv"),
        "QuantizeE4m3fn over float32 values (xla_ffi/common/fp8.h).");
  m.def("fp8_dequantize_rows", &Fp8DequantizeRows, nb::arg("dtype"), nb::arg("wire"),
        nb::arg("hidden"), "Tokens from FP8 wire rows (DequantizeRow).");
  m.def(
      "record_transport_error",
      [](const std::string& message) { RecordError(ErrorKind::kTransport, message); },
      nb::arg("message"),
      "Records a transport failure in the runtime's error log, as a handler would (a test reads it "
      "back through the production module: both modules share one runtime).");
  m.def("open_exchange_count", &OpenExchangeCount,
        "Exchanges waiting for ranks in this process (0 when idle).");
  m.def("call_site_state_count", &CallSiteStateCount,
        "Per-(call site, EP group, rank) generation counters held in this process (0 when idle).");
}

}  // namespace jax_hybridep
