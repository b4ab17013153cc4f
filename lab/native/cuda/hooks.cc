// Hooks of the transport that need no GPU (hooks.h): the references of the slot map and the
// row steps, which the numpy twin (tests/transport_twin.py) is checked against bit for bit; and
// the slot-map kernels on a GPU (or the host executor) against the same reference. Inputs are
// validated first: a bad index would make the reference write out of bounds.
#include "lab/native/cuda/hooks.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lab/native/cuda/hook_support.h"
#include "lab/native/cuda/reference.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/string.h"
#include "xla_ffi/common/fp8.h"
#include "xla_ffi/cuda/kernels/slot_map.h"
#include "xla_ffi/cuda/kernels/transport.h"

namespace jax_hybridep {
namespace {

// gathered [S, M, K, 3]: destinations in [-1, S), rows in [-1, rows), -1 together.
SlotMapShape CheckGathered(const CpuArray<int32_t>& gathered, int64_t rank, int64_t rows) {
  Require(gathered.ndim() == 4 && gathered.shape(3) == 3, "gathered: expected [S, M, K, 3]");
  const SlotMapShape shape{static_cast<int64_t>(gathered.shape(0)),
                           static_cast<int64_t>(gathered.shape(1)),
                           static_cast<int64_t>(gathered.shape(2)), rows};
  Require(shape.ranks >= 1 && shape.ranks <= kMaxWindowRanks && shape.k >= 1 && rows >= 0,
          "gathered: need 1 <= S <= 128, K >= 1 and rows >= 0");
  Require(rank >= 0 && rank < shape.ranks, "rank must be in [0, S)");
  const int32_t* g = gathered.data();
  for (size_t i = 0; i < gathered.size(); i += 3) {
    Require(g[i] >= -1 && g[i] < shape.ranks, "gathered: a destination outside [-1, S)");
    Require(g[i + 1] >= -1 && g[i + 1] < rows, "gathered: a row outside [-1, rows)");
    Require((g[i] < 0) == (g[i + 1] < 0), "gathered: destination and row disagree on -1");
  }
  return shape;
}

nb::dict Layout(CpuArray<int32_t> gathered, int64_t rank, int64_t rows, bool reference) {
  const SlotMapShape shape = CheckGathered(gathered, rank, rows);
  const int64_t S = shape.ranks, M = shape.items, K = shape.k;
  const size_t mp = ChunkPadded(M), np = ChunkPadded(S * M);
  std::vector<int32_t> send_slot(mp * S), recv_item(np), recv_rows(np * K), row_slot(rows), info(2);
  std::vector<float> row_weights(rows);
  if (reference) {
    SlotMapReference(shape, static_cast<int32_t>(rank), gathered.data(), send_slot.data(),
                     recv_item.data(), recv_rows.data(), row_weights.data(), row_slot.data(),
                     info.data());
  } else {
    GpuSession gpu;
    const int32_t r32 = static_cast<int32_t>(rank);
    // The outputs and the scratch as XLA hands them over: not zeroed (the kernels' own duty).
    int32_t* d_send = gpu.Uninitialised<int32_t>(send_slot.size());
    int32_t* d_item = gpu.Uninitialised<int32_t>(np);
    int32_t* d_rows = gpu.Uninitialised<int32_t>(np * K);
    float* d_weights = gpu.Uninitialised<float>(rows);
    int32_t* d_slot = gpu.Uninitialised<int32_t>(rows);
    int32_t* d_info = gpu.Uninitialised<int32_t>(2);
    CheckCuda(
        LaunchSlotMap(shape, gpu.Upload(&r32, 1), gpu.Upload(gathered.data(), gathered.size()),
                      d_send, d_item, d_rows, d_weights, d_slot, d_info,
                      gpu.Uninitialised<char>(SlotMapWorkspaceBytes(shape)), gpu.stream()),
        "LaunchSlotMap");
    send_slot = gpu.Download(d_send, send_slot.size());
    recv_item = gpu.Download(d_item, np);
    recv_rows = gpu.Download(d_rows, np * K);
    row_weights = gpu.Download(d_weights, rows);
    row_slot = gpu.Download(d_slot, rows);
    info = gpu.Download(d_info, 2);
  }
  const size_t s = S, k = K, c = rows;
  nb::dict out;
  out["send_slot"] = ToNumpy(std::move(send_slot), {mp, s});
  out["recv_item"] = ToNumpy(std::move(recv_item), {np});
  out["recv_rows"] = ToNumpy(std::move(recv_rows), {np, k});
  out["row_weights"] = ToNumpy(std::move(row_weights), {c});
  out["row_slot"] = ToNumpy(std::move(row_slot), {c});
  out["info"] = ToNumpy(std::move(info), {2});
  return out;
}

// A receiver's metadata as the layout gives it: n = info[0] slots, each row filled at most once,
// row_slot consistent with recv_rows.
void CheckReceiverMaps(const CpuArray<int32_t>& recv_rows, const CpuArray<int32_t>& row_slot,
                       const CpuArray<int32_t>& info, int64_t slots, int64_t rows) {
  Require(recv_rows.ndim() == 2, "recv_rows: expected [slots, K]");
  RequireShape(row_slot, "row_slot", {rows});
  RequireShape(info, "info", {2});
  const int64_t K = recv_rows.shape(1), n = info.data()[0];
  Require(n >= 0 && n <= slots && static_cast<int64_t>(recv_rows.shape(0)) >= n,
          "info[0] must be a slot count within the buffers");
  Require(info.data()[1] >= 0 && info.data()[1] <= rows, "info[1] must be in [0, rows]");
  std::vector<int32_t> filled(rows, -1);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t r = recv_rows.data()[j * K + k];
      Require(r >= -1 && r < rows, "recv_rows: a row outside [-1, rows)");
      if (r < 0) continue;
      Require(filled[r] < 0, "recv_rows: a row is filled twice");
      filled[r] = static_cast<int32_t>(j);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    Require(row_slot.data()[r] == filled[r], "row_slot disagrees with recv_rows");
  }
}

nb::tuple ReferencePermute(const std::string& dtype_name, CpuArray<uint8_t> slots,
                           int64_t row_bytes, CpuArray<int32_t> recv_rows,
                           CpuArray<int32_t> row_slot, CpuArray<int32_t> info,
                           int64_t zero_pad_multiple, int64_t fp8_hidden,
                           std::optional<CpuArray<float>> scale) {
  const Dtype dtype = ParseDtype(dtype_name);
  Require(slots.ndim() == 2, "slots: expected [n, slot_stride]");
  const int64_t rows = row_slot.ndim() == 1 ? row_slot.shape(0) : -1;
  CheckReceiverMaps(recv_rows, row_slot, info, slots.shape(0), rows);
  const int64_t stride = slots.shape(1);
  Require(row_bytes > 0 && row_bytes <= stride, "row_bytes must be in (0, slot_stride]");
  Require(zero_pad_multiple >= 0, "zero_pad_multiple must be >= 0");
  Require(fp8_hidden == 0 || row_bytes == Fp8WireBytes(fp8_hidden),
          "FP8 slots are wire rows of fp8_hidden elements");
  Require(fp8_hidden > 0 || !scale || row_bytes % DtypeBytes(dtype) == 0,
          "row_bytes is not whole elements");
  if (scale) RequireShape(*scale, "scale", {rows});
  const int64_t out_row_bytes = fp8_hidden > 0 ? fp8_hidden * DtypeBytes(dtype) : row_bytes;
  const SlotMapShape shape{0, 0, static_cast<int64_t>(recv_rows.shape(1)), rows};
  std::vector<uint8_t> out(rows * out_row_bytes, 0xab), scaled(scale ? out.size() : 0, 0xab);
  PermuteReference(shape, reinterpret_cast<const char*>(slots.data()), stride, row_bytes,
                   recv_rows.data(), row_slot.data(), info.data(), zero_pad_multiple,
                   reinterpret_cast<char*>(out.data()), dtype, fp8_hidden,
                   scale ? scale->data() : nullptr, reinterpret_cast<char*>(scaled.data()));
  const size_t c = rows, b = out_row_bytes;
  nb::object scaled_out = scale ? ToNumpy(std::move(scaled), {c, b}) : nb::none();
  return nb::make_tuple(ToNumpy(std::move(out), {c, b}), scaled_out);
}

nb::object ReferenceUnpermute(const std::string& dtype_name, CpuArray<uint8_t> y,
                              std::optional<CpuArray<float>> weights, CpuArray<int32_t> recv_rows,
                              CpuArray<int32_t> row_slot, CpuArray<int32_t> info) {
  const Dtype dtype = ParseDtype(dtype_name);
  Require(y.ndim() == 2 && y.shape(1) % DtypeBytes(dtype) == 0, "y: expected [C, row_bytes]");
  const int64_t rows = y.shape(0), row_bytes = y.shape(1);
  CheckReceiverMaps(recv_rows, row_slot, info, recv_rows.shape(0), rows);
  if (weights) RequireShape(*weights, "weights", {rows});
  const int64_t n = info.data()[0];
  const SlotMapShape shape{0, 0, static_cast<int64_t>(recv_rows.shape(1)), rows};
  std::vector<uint8_t> partials(n * row_bytes);
  UnpermuteReference(shape, dtype, row_bytes / DtypeBytes(dtype),
                     reinterpret_cast<const char*>(y.data()), weights ? weights->data() : nullptr,
                     recv_rows.data(), info.data(), reinterpret_cast<char*>(partials.data()));
  return ToNumpy(std::move(partials), {static_cast<size_t>(n), static_cast<size_t>(row_bytes)});
}

nb::object ReferenceReduce(const std::string& dtype_name, CpuArray<uint8_t> partials,
                           CpuArray<int32_t> dest) {
  const Dtype dtype = ParseDtype(dtype_name);
  Require(partials.ndim() == 3, "partials: expected [S, M, row_bytes]");
  const int64_t S = partials.shape(0), M = partials.shape(1), row_bytes = partials.shape(2);
  Require(row_bytes % DtypeBytes(dtype) == 0, "partials: row_bytes is not whole elements");
  Require(dest.ndim() == 2 && static_cast<int64_t>(dest.shape(0)) == M, "dest: expected [M, K]");
  RequireRange(dest.data(), dest.size(), S, "dest");
  const SlotMapShape shape{S, M, static_cast<int64_t>(dest.shape(1)), 0};
  std::vector<uint8_t> out(M * row_bytes);
  ReduceReference(shape, dtype, row_bytes / DtypeBytes(dtype),
                  reinterpret_cast<const char*>(partials.data()), dest.data(),
                  reinterpret_cast<char*>(out.data()));
  return ToNumpy(std::move(out), {static_cast<size_t>(M), static_cast<size_t>(row_bytes)});
}

}  // namespace

void RegisterTransportHooks(nb::module_& m) {
  m.def("cuda_slot_map", &Layout, nb::arg("gathered"), nb::arg("rank"), nb::arg("rows"),
        nb::arg("reference") = true,
        "The slot map of `rank` from the gathered routing [S, M, K, 3] (destination, "
        "row, weight bits): the reference, or (reference=False) the CUDA kernels. Returns "
        "a dict of send_slot, recv_item, recv_rows, row_weights, row_slot, info.");
  m.def("cuda_reference_permute", &ReferencePermute, nb::arg("dtype"), nb::arg("slots"),
        nb::arg("row_bytes"), nb::arg("recv_rows"), nb::arg("row_slot"), nb::arg("info"),
        nb::arg("zero_pad_multiple") = 0, nb::arg("fp8_hidden") = 0,
        nb::arg("scale").none() = nb::none(),
        "Reference of the permute (rows untouched by it are 0xab). Returns (rows, "
        "scaled or None), uint8.");
  m.def("cuda_reference_unpermute", &ReferenceUnpermute, nb::arg("dtype"), nb::arg("y"),
        nb::arg("weights").none(), nb::arg("recv_rows"), nb::arg("row_slot"), nb::arg("info"),
        "Reference of the unpermute. Returns the partials [n, row_bytes], uint8.");
  m.def("cuda_reference_reduce", &ReferenceReduce, nb::arg("dtype"), nb::arg("partials"),
        nb::arg("dest"),
        "Reference of the reduce (partials [S, M, row_bytes] at [source d, item m]). "
        "Returns [M, row_bytes], uint8.");
}

}  // namespace jax_hybridep
