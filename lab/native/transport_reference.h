// The direct-write transport's rounds as the test module takes them ([N, R, ...] inputs: N rounds
// of dispatch, combine, redispatch (scaled) and row values over R ranks), and their results by the
// host kernels the host handlers run (exchange.h's pull transport): the reference the numpy model
// of docs/design.md §2.1 is checked against, so a GPU run only has the CUDA kernels left to test.
#ifndef JAX_HYBRIDEP_LAB_NATIVE_TRANSPORT_REFERENCE_H_
#define JAX_HYBRIDEP_LAB_NATIVE_TRANSPORT_REFERENCE_H_

#include <cstdint>
#include <optional>

#include "lab/native/array_hooks.h"
#include "nanobind/nanobind.h"
#include "xla_ffi/common/numeric.h"

namespace jax_hybridep {

// Inputs of N rounds over R ranks (byte arrays are uint8, rows of row_bytes), validated.
struct TransportRounds {
  Dtype dtype;
  int64_t N, R, T, K, C, row_bytes;
  HostArray<uint8_t> x;        // [N, R, T, row_bytes]: dispatched tokens
  HostArray<int32_t> dest;     // [N, R, T, K]: destination rank per (t, k), -1: none
  HostArray<int32_t> row_pos;  // [N, R, T, K]: the row there (-1 exactly where dest is)
  HostArray<float> weights;    // [N, R, T, K]: routing weights
  HostArray<uint8_t> y;        // [N, R, C, row_bytes]: combined rows
  std::optional<HostArray<float>> y_weights;  // [N, R, C] or none: combine unweighted
  HostArray<uint8_t> g;                       // [N, R, T, row_bytes]: redispatched tokens
  HostArray<float> scale;                     // [N, R, C]: redispatch's row scales
  HostArray<float> values;                    // [N, R, C]: row values sent back
};

// Checks shapes, ranges and dest/row_pos agreement (ValueError naming the argument otherwise).
TransportRounds CheckTransportRounds(const std::string& dtype, int64_t rows, HostArray<uint8_t> x,
                                     HostArray<int32_t> dest, HostArray<int32_t> row_pos,
                                     HostArray<float> weights, HostArray<uint8_t> y,
                                     std::optional<HostArray<float>> y_weights,
                                     HostArray<uint8_t> g, HostArray<float> scale,
                                     HostArray<float> values);

// Adds transport_reference() to `m`.
void RegisterTransportReference(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_TRANSPORT_REFERENCE_H_
