// Hooks of the layout step's CUDA kernels (kernels/row_layout.h) on the test module, for tests
// marked `gpu`: cuda_selftest_layout runs them on numpy inputs (or, with reference=True, the CPU
// kernels of the same name), and cuda_device_count. Inputs are validated first: a bad row index
// would make the CUDA kernels fault. Plain C++ against the CUDA runtime API.
#include "lab/native/cuda/layout_hooks.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "lab/native/cuda/hook_support.h"
#include "nanobind/nanobind.h"
#include "xla_ffi/common/layout.h"
#include "xla_ffi/cuda/kernels/row_layout.h"

namespace nb = nanobind;

namespace jax_hybridep {
namespace {
nb::dict SelftestLayout(CpuArray<int32_t> topk_idx, int64_t num_experts,
                        CpuArray<int64_t> placement_rank, CpuArray<int64_t> placement_slot,
                        int64_t num_slots, int64_t capacity, int64_t rows, int64_t pad_multiple,
                        bool reference) {
  Require(topk_idx.ndim() == 3, "topk_idx: expected [R, T, K]");
  const int64_t R = topk_idx.shape(0), T = topk_idx.shape(1), K = topk_idx.shape(2);
  const int64_t E = num_experts;
  Require(R > 0 && E > 0 && num_slots > 0 && pad_multiple > 0 && rows >= 0,
          "need R, num_experts, num_slots, pad_multiple > 0 and rows >= 0");
  RequireShape(placement_rank, "placement_rank", {E});
  RequireShape(placement_slot, "placement_slot", {E});
  for (int64_t e = 0; e < E; ++e) {
    Require(placement_rank.data()[e] >= 0 && placement_rank.data()[e] < R &&
                placement_slot.data()[e] >= 0 && placement_slot.data()[e] < num_slots,
            "placement of expert " + std::to_string(e) + " is outside [0, R) x [0, num_slots)");
  }
  const CapacityPlan plan{capacity, rows, pad_multiple};
  std::vector<int32_t> counts(R * E), keep(E), offset(E), sizes(R * num_slots), tpe(E);
  std::vector<int32_t> row_pos(R * T * K);
  std::vector<int64_t> invalid(R), dropped(R), dropped_per_source(R);
  if (reference) {
    const Placement placement{placement_rank.data(), placement_slot.data(), E, R, num_slots};
    const int32_t* idx = topk_idx.data();
    for (int64_t r = 0; r < R; ++r) {
      invalid[r] = CountRows(idx + r * T * K, T, K, E, counts.data() + r * E);
    }
    PlanGroups(counts.data(), placement, plan, keep.data(), offset.data(), sizes.data(),
               tpe.data());
    for (int64_t r = 0; r < R; ++r) {
      dropped[r] = AssignRows(idx + r * T * K, T, K, r, counts.data(), placement, keep.data(),
                              offset.data(), row_pos.data() + r * T * K);
    }
    DroppedPerSource(counts.data(), R, E, keep.data(), dropped_per_source.data());
  } else {
    // The handler's part of the layout on the GPU: PlanGroups and AssignRows over the counts XLA
    // all-gathers in production (counted here on the CPU, as jnp counts them there).
    for (int64_t r = 0; r < R; ++r) {
      CountRows(topk_idx.data() + r * T * K, T, K, E, counts.data() + r * E);
    }
    GpuSession gpu;
    cudaStream_t s = gpu.stream();
    const int32_t* idx = gpu.Upload(topk_idx.data(), R * T * K);
    const Placement placement{gpu.Upload(placement_rank.data(), E),
                              gpu.Upload(placement_slot.data(), E), E, R, num_slots};
    const int32_t* d_counts = gpu.Upload(counts.data(), R * E);
    // The handler's scratch (cudaMalloc'd once per call site) and XLA's outputs: not zeroed,
    // as there (under the host executor, poison it reports reading).
    int32_t* d_keep = gpu.Uninitialised<int32_t>(E);
    int32_t* d_offset = gpu.Uninitialised<int32_t>(E);
    int32_t* d_sizes = gpu.Uninitialised<int32_t>(R * num_slots);
    int32_t* d_tpe = gpu.Uninitialised<int32_t>(E);
    int32_t* d_row_pos = gpu.Uninitialised<int32_t>(R * T * K);
    int64_t* d_dropped = gpu.Uninitialised<int64_t>(R);
    const size_t workspace_bytes = AssignRowsWorkspaceBytes(T, K, E);
    void* workspace = gpu.Uninitialised<char>(workspace_bytes);
    CheckCuda(LaunchPlanGroups(d_counts, placement, plan, d_keep, d_offset, d_sizes, d_tpe, s),
              "LaunchPlanGroups");
    for (int64_t r = 0; r < R; ++r) {
      CheckCuda(
          LaunchAssignRows(idx + r * T * K, T, K, r, d_counts, placement, d_keep, d_offset,
                           d_row_pos + r * T * K, d_dropped + r, workspace, workspace_bytes, s),
          "LaunchAssignRows");
    }
    keep = gpu.Download(d_keep, E);
    offset = gpu.Download(d_offset, E);
    sizes = gpu.Download(d_sizes, R * num_slots);
    tpe = gpu.Download(d_tpe, E);
    row_pos = gpu.Download(d_row_pos, R * T * K);
    dropped = gpu.Download(d_dropped, R);
  }
  const size_t r = R, e = E, t = T, k = K, slots = num_slots;
  nb::dict out;
  if (reference) {  // the steps the GPU does not run (the counts are its input)
    out["counts"] = ToNumpy(std::move(counts), {r, e});
    out["invalid"] = ToNumpy(std::move(invalid), {r});
    out["dropped_per_source"] = ToNumpy(std::move(dropped_per_source), {r});
  }
  out["keep_limit"] = ToNumpy(std::move(keep), {e});
  out["group_offset"] = ToNumpy(std::move(offset), {e});
  out["group_sizes"] = ToNumpy(std::move(sizes), {r, slots});
  out["tokens_per_expert"] = ToNumpy(std::move(tpe), {e});
  out["row_pos"] = ToNumpy(std::move(row_pos), {r, t, k});
  out["dropped"] = ToNumpy(std::move(dropped), {r});
  return out;
}

}  // namespace

void RegisterLayoutHooks(nb::module_& m) {
  m.def("cuda_device_count", &CudaDeviceCount,
        "Visible CUDA devices; 0 when there is no driver or GPU.");
  m.def("cuda_selftest_layout", &SelftestLayout, nb::arg("topk_idx"), nb::arg("num_experts"),
        nb::arg("placement_rank"), nb::arg("placement_slot"), nb::arg("num_slots"),
        nb::arg("capacity"), nb::arg("rows"), nb::arg("pad_multiple"), nb::arg("reference") = false,
        "Layout of all ranks (topk_idx [R, T, K]): PlanGroups and AssignRows on the GPU over the "
        "CPU's counts, or with reference=True every step (CountRows, PlanGroups, AssignRows, "
        "DroppedPerSource) on the CPU, whose dict also holds counts, invalid and "
        "dropped_per_source.");
}

}  // namespace jax_hybridep
