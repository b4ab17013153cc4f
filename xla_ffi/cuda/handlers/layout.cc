// The CUDA layout handler (docs/design.md §2.1.2-3): every (t, k) gets its destination row from
// the per-(source rank, expert) counts an XLA collective all-gathered over the EP group
// [R, E + 1], by the CUDA layout kernels (kernels/row_layout.h), never waiting for the GPU (strict
// mode syncs to raise). The placement and the kernels' scratch are the call site's, on each device
// (state/site_state.h).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_support.h"
#include "xla_ffi/cuda/handlers/registry.h"
#include "xla_ffi/cuda/handlers/support.h"
#include "xla_ffi/cuda/kernels/row_layout.h"
#include "xla_ffi/cuda/state/site_state.h"

namespace jax_hybridep {
namespace ffi = xla::ffi;
namespace {

// Layout from the counts all-gathered by an XLA collective [R, E + 1]: plan groups and assign
// rows with the CUDA layout kernels (kernels/row_layout.h), never waiting for the GPU (strict mode
// syncs to raise).
ffi::Error LayoutImpl(cudaStream_t stream, int32_t device, SiteState* state,
                      ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::S32> gathered,
                      ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                      LayoutAttrsView layout, ffi::ResultBuffer<ffi::S32> row_pos,
                      ffi::ResultBuffer<ffi::S32> group_sizes,
                      ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                      ffi::ResultBuffer<ffi::S64> dropped, ffi::ResultBuffer<ffi::S32> invalid) {
  auto site_or = state->OnDevice(device, stream, rank, group);
  if (site_or.has_error()) return site_or.error();
  DeviceSite& site = *site_or.value();
  const int64_t T = topk_idx.dimensions()[0], K = topk_idx.dimensions()[1];
  const int64_t num_ranks = layout.num_ranks, num_slots = layout.num_slots;
  const ffi::Span<const int64_t> expert_rank = layout.expert_rank, expert_slot = layout.expert_slot;
  const int64_t E = static_cast<int64_t>(expert_rank.size());
  cudaError_t s = cudaSuccess;
  if (site.expert_rank == nullptr) {  // First call: placement on the device, scratch.
    DeviceScratch& d = site.scratch;
    site.workspace_bytes = AssignRowsWorkspaceBytes(T, K, E);
    char* workspace = nullptr;
    for (cudaError_t a : {d.Allocate(E, &site.expert_rank), d.Allocate(E, &site.expert_slot),
                          d.Allocate(num_ranks * E, &site.all_counts),
                          d.Allocate(E, &site.keep_limit), d.Allocate(E, &site.group_offset),
                          d.Allocate(num_ranks * num_slots, &site.all_group_sizes),
                          d.Allocate(site.workspace_bytes, &workspace)}) {
      if (a != cudaSuccess) return CudaError(a, "cudaMalloc (layout scratch)");
    }
    site.workspace = workspace;
    // On this call's stream (the attribute spans outlive it): a synchronous copy on the legacy
    // stream could wait for other streams' exchanges, which may wait for peers.
    s = cudaMemcpyAsync(site.expert_rank, expert_rank.begin(), E * sizeof(int64_t),
                        cudaMemcpyHostToDevice, stream);
    if (s == cudaSuccess) {
      s = cudaMemcpyAsync(site.expert_slot, expert_slot.begin(), E * sizeof(int64_t),
                          cudaMemcpyHostToDevice, stream);
    }
    if (s != cudaSuccess) return CudaError(s, "copying the placement");
  }
  // all_counts [R, E] and this rank's invalid count out of gathered [R, E + 1].
  s = cudaMemcpy2DAsync(site.all_counts, E * sizeof(int32_t), gathered.typed_data(),
                        (E + 1) * sizeof(int32_t), E * sizeof(int32_t), num_ranks,
                        cudaMemcpyDeviceToDevice, stream);
  if (s == cudaSuccess) {
    s = cudaMemcpyAsync(invalid->typed_data(), gathered.typed_data() + site.rank * (E + 1) + E,
                        sizeof(int32_t), cudaMemcpyDeviceToDevice, stream);
  }
  const Placement placement{site.expert_rank, site.expert_slot, E, num_ranks, num_slots};
  if (s == cudaSuccess) {
    s = LaunchPlanGroups(site.all_counts, placement,
                         CapacityPlan{layout.capacity, layout.rows, layout.pad_multiple},
                         site.keep_limit, site.group_offset, site.all_group_sizes,
                         tokens_per_expert->typed_data(), stream);
  }
  if (s == cudaSuccess) {
    s = LaunchAssignRows(topk_idx.typed_data(), T, K, site.rank, site.all_counts, placement,
                         site.keep_limit, site.group_offset, row_pos->typed_data(),
                         dropped->typed_data(), site.workspace, site.workspace_bytes, stream);
  }
  if (s == cudaSuccess) {
    s = cudaMemcpyAsync(group_sizes->typed_data(), site.all_group_sizes + site.rank * num_slots,
                        num_slots * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream);
  }
  if (s != cudaSuccess) return CudaError(s, "layout");
  if (!layout.strict) return ffi::Error::Success();
  // Strict mode is a debugging aid: it waits for the counts to fail on every rank at once.
  std::vector<int32_t> counts(num_ranks * (E + 1));
  s = cudaMemcpyAsync(counts.data(), gathered.typed_data(), counts.size() * sizeof(int32_t),
                      cudaMemcpyDeviceToHost, stream);
  if (s == cudaSuccess) s = cudaStreamSynchronize(stream);
  if (s != cudaSuccess) return CudaError(s, "strict-mode check");
  const LayoutAttrs attrs = MakeLayoutAttrs(layout);
  return ToError(StrictCheck(attrs, PlanGroup(attrs, counts.data()), site.group));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kCudaLayout, LayoutImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<SiteState>>()
                           .Arg<ffi::Buffer<ffi::S32>>()  // topk_idx [T, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // gathered counts [R, E + 1]
                           .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                           .Arg<ffi::Buffer<ffi::S32>>()  // group []
                           .Attrs<LayoutAttrsView>()
                           .Ret<ffi::Buffer<ffi::S32>>()    // row_pos [T, K]
                           .Ret<ffi::Buffer<ffi::S32>>()    // group_sizes [E_local]
                           .Ret<ffi::Buffer<ffi::S32>>()    // tokens_per_expert [E]
                           .Ret<ffi::Buffer<ffi::S64>>()    // dropped []
                           .Ret<ffi::Buffer<ffi::S32>>());  // invalid []

std::vector<HandlerEntry> CudaLayoutHandlers() {
  return {{"jax_hybridep_cuda_layout", kCudaLayout}};
}

}  // namespace jax_hybridep
