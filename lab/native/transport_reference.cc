// The transport's rounds by the CPU kernels (transport_reference.h).
#include "lab/native/transport_reference.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "lab/native/array_hooks.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/string.h"
#include "xla_ffi/common/limits.h"
#include "xla_ffi/common/numeric.h"
#include "xla_ffi/cpu/kernels/exchange.h"

namespace nb = nanobind;

namespace jax_hybridep {
namespace {

// Inputs of N rounds over R ranks (byte arrays are uint8, rows of row_bytes), validated.
struct TransportRounds {
  Dtype dtype;
  int64_t N, R, T, K, C, row_bytes;
  CpuArray<uint8_t> x;        // [N, R, T, row_bytes]: dispatched tokens
  CpuArray<int32_t> dest;     // [N, R, T, K]: destination rank per (t, k), -1: none
  CpuArray<int32_t> row_pos;  // [N, R, T, K]: the row there (-1 exactly where dest is)
  CpuArray<float> weights;    // [N, R, T, K]: routing weights
  CpuArray<uint8_t> y;        // [N, R, C, row_bytes]: combined rows
  std::optional<CpuArray<float>> y_weights;  // [N, R, C] or none: combine unweighted
  CpuArray<uint8_t> g;                       // [N, R, T, row_bytes]: redispatched tokens
  CpuArray<float> scale;                     // [N, R, C]: redispatch's row scales
  CpuArray<float> values;                    // [N, R, C]: row values sent back
};

// Checks shapes, ranges and dest/row_pos agreement (ValueError naming the argument otherwise).
TransportRounds CheckTransportRounds(const std::string& dtype, int64_t rows, CpuArray<uint8_t> x,
                                     CpuArray<int32_t> dest, CpuArray<int32_t> row_pos,
                                     CpuArray<float> weights, CpuArray<uint8_t> y,
                                     std::optional<CpuArray<float>> y_weights, CpuArray<uint8_t> g,
                                     CpuArray<float> scale, CpuArray<float> values) {
  TransportRounds in{ParseDtype(dtype), 0,       0, 0,         0, rows,  0,     x, dest,
                     row_pos,           weights, y, y_weights, g, scale, values};
  Require(x.ndim() == 4 && dest.ndim() == 4, "x: expected [N, R, T, row_bytes], dest [N, R, T, K]");
  in.N = x.shape(0), in.R = x.shape(1), in.T = x.shape(2), in.row_bytes = x.shape(3);
  in.K = dest.shape(3);
  const int64_t N = in.N, R = in.R, T = in.T, K = in.K, C = rows, rb = in.row_bytes;
  Require(N >= 1 && R >= 1 && R <= kMaxWindowRanks, "need N >= 1 rounds and 1 <= R <= 128");
  Require(K >= 1 && K <= kMaxTopK, "K must be in [1, 64]");
  Require(C >= 0, "rows must be >= 0");
  Require(rb % DtypeBytes(in.dtype) == 0, "x: row_bytes is not whole elements");
  RequireShape(dest, "dest", {N, R, T, K});
  RequireShape(row_pos, "row_pos", {N, R, T, K});
  RequireShape(weights, "weights", {N, R, T, K});
  RequireShape(y, "y", {N, R, C, rb});
  if (y_weights) RequireShape(*y_weights, "y_weights", {N, R, C});
  RequireShape(g, "g", {N, R, T, rb});
  RequireShape(scale, "scale", {N, R, C});
  RequireShape(values, "values", {N, R, C});
  RequireRange(dest.data(), dest.size(), R, "dest");
  RequireRange(row_pos.data(), row_pos.size(), C, "row_pos");
  for (size_t i = 0; i < dest.size(); ++i) {
    Require((dest.data()[i] < 0) == (row_pos.data()[i] < 0), "dest and row_pos disagree on -1");
  }
  return in;
}

// Every output of N rounds, [N, R, ...] as the GPU hook returns them.
nb::dict Reference(const TransportRounds& in) {
  const int64_t N = in.N, R = in.R, T = in.T, K = in.K, C = in.C, rb = in.row_bytes;
  const ExchangeShape shape{R, T, K, C, rb};
  std::vector<uint8_t> tokens(N * R * C * rb), redispatched(N * R * C * rb), scaled(N * R * C * rb),
      combined(N * R * T * rb);
  std::vector<float> weights(N * R * C), row_values(N * R * T * K);
  std::vector<int32_t> recv_row_pos(N * R * R * T * K, -1);
  auto bytes = [](const CpuArray<uint8_t>& a, int64_t at) {
    return reinterpret_cast<const char*>(a.data()) + at;
  };
  for (int64_t n = 0; n < N; ++n) {
    const int64_t tk = (n * R) * T * K;  // round n's first (rank, t, k)
    std::vector<SourceRows> tokens_from(R), g_from(R);
    std::vector<const char*> y(R);
    std::vector<const float*> y_weights(R), values(R);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = tk + r * T * K;
      tokens_from[r] = {bytes(in.x, (n * R + r) * T * rb), in.dest.data() + at,
                        in.row_pos.data() + at, in.weights.data() + at};
      g_from[r] = {bytes(in.g, (n * R + r) * T * rb), in.dest.data() + at, in.row_pos.data() + at,
                   nullptr};
      y[r] = bytes(in.y, (n * R + r) * C * rb);
      y_weights[r] = in.y_weights ? in.y_weights->data() + (n * R + r) * C : nullptr;
      values[r] = in.values.data() + (n * R + r) * C;
    }
    for (int64_t d = 0; d < R; ++d) {  // destination side: rows, redispatched and scaled rows
      const int64_t rows_at = (n * R + d) * C;
      RowOutputs dispatch;
      dispatch.tokens = reinterpret_cast<char*>(tokens.data()) + rows_at * rb;
      dispatch.weights = weights.data() + rows_at;
      PullRows(shape, d, tokens_from.data(), in.dtype, dispatch);
      RowOutputs redispatch;
      redispatch.tokens = reinterpret_cast<char*>(redispatched.data()) + rows_at * rb;
      redispatch.scale = in.scale.data() + rows_at;
      redispatch.scaled = reinterpret_cast<char*>(scaled.data()) + rows_at * rb;
      PullRows(shape, d, g_from.data(), in.dtype, redispatch);
    }
    for (int64_t src = 0; src < R; ++src) {  // source side: combine, row values, receive maps
      const int64_t at = tk + src * T * K;
      PullCombine(shape, in.dtype, y.data(), in.y_weights ? y_weights.data() : nullptr,
                  in.dest.data() + at, in.row_pos.data() + at,
                  reinterpret_cast<char*>(combined.data()) + (n * R + src) * T * rb);
      PullRowValues(shape, values.data(), in.dest.data() + at, in.row_pos.data() + at,
                    row_values.data() + at);
      // The receiver's map of its rows to (source, t, k): what dispatch hands combine.
      for (int64_t i = 0; i < T * K; ++i) {
        const int32_t d = in.dest.data()[at + i];
        if (d >= 0)
          recv_row_pos[((n * R + d) * R * T + src * T) * K + i] = in.row_pos.data()[at + i];
      }
    }
  }
  const size_t n = N, r = R, t = T, k = K, c = C, b = rb;
  nb::dict out;
  out["tokens"] = ToNumpy(std::move(tokens), {n, r, c, b});
  out["weights"] = ToNumpy(std::move(weights), {n, r, c});
  out["recv_row_pos"] = ToNumpy(std::move(recv_row_pos), {n, r, r * t, k});
  out["combined"] = ToNumpy(std::move(combined), {n, r, t, b});
  out["redispatched"] = ToNumpy(std::move(redispatched), {n, r, c, b});
  out["scaled"] = ToNumpy(std::move(scaled), {n, r, c, b});
  out["row_values"] = ToNumpy(std::move(row_values), {n, r, t, k});
  return out;
}

}  // namespace

void RegisterTransportReference(nb::module_& m) {
  m.def(
      "transport_reference",
      [](const std::string& dtype, int64_t rows, CpuArray<uint8_t> x, CpuArray<int32_t> dest,
         CpuArray<int32_t> row_pos, CpuArray<float> weights, CpuArray<uint8_t> y,
         std::optional<CpuArray<float>> y_weights, CpuArray<uint8_t> g, CpuArray<float> scale,
         CpuArray<float> values) {
        return Reference(CheckTransportRounds(dtype, rows, x, dest, row_pos, weights, y, y_weights,
                                              g, scale, values));
      },
      nb::arg("dtype"), nb::arg("rows"), nb::arg("x"), nb::arg("dest"), nb::arg("row_pos"),
      nb::arg("weights"), nb::arg("y"), nb::arg("y_weights").none(), nb::arg("g"), nb::arg("scale"),
      nb::arg("values"),
      "The transport's N rounds (dispatch, combine, redispatch scaled, row values; inputs "
      "[N, R, ...] as cuda_selftest_transport takes them) by the host handlers' CPU kernels "
      "(exchange.h: PullRows, PullCombine, PullRowValues). Returns the same dict of [N, R, ...] "
      "results, without a GPU.");
}

}  // namespace jax_hybridep
