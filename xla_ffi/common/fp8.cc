#include "xla_ffi/common/fp8.h"

#include <array>

#include "xla_ffi/common/row_kernel.h"

namespace jax_hybridep {

const float* Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int q = 0; q < 256; ++q) t[q] = E4m3fnToFloat(static_cast<uint8_t>(q));
    return t;
  }();
  return table.data();
}

JAX_HYBRIDEP_ROW_KERNEL void QuantizeRow(const void* x, int64_t hidden, Dtype dtype,
                                         uint8_t* wire) {
  switch (dtype) {
    case Dtype::kF32:
      return QuantizeRowT<Dtype::kF32>(x, hidden, wire);
    case Dtype::kBF16:
      return QuantizeRowT<Dtype::kBF16>(x, hidden, wire);
    case Dtype::kF16:
      return QuantizeRowT<Dtype::kF16>(x, hidden, wire);
  }
}

JAX_HYBRIDEP_ROW_KERNEL void DequantizeRow(const uint8_t* wire, int64_t hidden, Dtype dtype,
                                           void* out) {
  const float* table = Fp8Table();
  switch (dtype) {
    case Dtype::kF32:
      return DequantizeRowT<Dtype::kF32>(wire, hidden, table, out);
    case Dtype::kBF16:
      return DequantizeRowT<Dtype::kBF16>(wire, hidden, table, out);
    case Dtype::kF16:
      return DequantizeRowT<Dtype::kF16>(wire, hidden, table, out);
  }
}

}  // namespace jax_hybridep
