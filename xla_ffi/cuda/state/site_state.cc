// Per-site state of the CUDA handlers (site_state.h).
#include "xla_ffi/cuda/state/site_state.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_hybridep {
namespace ffi = xla::ffi;
namespace {

std::atomic<int64_t> live_states{0};

// Runs on `device` and restores the caller's device after (XLA may delete an executable on any
// thread).
class OnDeviceScope {
 public:
  explicit OnDeviceScope(int32_t device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) cudaSetDevice(device);
  }
  ~OnDeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
    cudaGetLastError();  // A failure here has nobody to report to; do not leave it pending.
  }

 private:
  int previous_ = -1;
};

ffi::ErrorOr<std::unique_ptr<SiteState>> Instantiate() { return std::make_unique<SiteState>(); }

const ffi::TypeInfo kSiteStateInfo = ffi::MakeTypeInfo<SiteState>();

}  // namespace

XLA_FFI_DEFINE_HANDLER(kSiteStateInstantiate, Instantiate, ffi::Ffi::BindInstantiate());

ffi::TypeId SiteState::id = {};

void DeviceScratch::Release() {
  for (void* p : blocks_) cudaFree(p);
  blocks_.clear();
}

DeviceSite::~DeviceSite() {
  OnDeviceScope on(device);
  scratch.Release();
}

SiteState::SiteState() { live_states.fetch_add(1); }

SiteState::~SiteState() { live_states.fetch_sub(1); }

// Read by the test module only (declared in lab/native/cuda/introspection.h).
int64_t LiveSiteStates() { return live_states.load(); }

ffi::ErrorOr<DeviceSite*> SiteState::OnDevice(int32_t device, cudaStream_t stream,
                                              ffi::Buffer<ffi::S32> rank,
                                              ffi::Buffer<ffi::S32> group) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = devices_.find(device);
    if (it != devices_.end()) return it->second.get();
  }
  int32_t ids[2];
  cudaError_t s = cudaSetDevice(device);  // The site's scratch and window live on this device.
  if (s == cudaSuccess) {
    s = cudaMemcpyAsync(&ids[0], rank.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToHost,
                        stream);
  }
  if (s == cudaSuccess) {
    s = cudaMemcpyAsync(&ids[1], group.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToHost,
                        stream);
  }
  if (s == cudaSuccess) s = cudaStreamSynchronize(stream);
  if (s != cudaSuccess) {
    cudaGetLastError();
    return ffi::Unexpected(ffi::Error::Internal(
        std::string("jax_hybridep: reading the EP rank failed: ") + cudaGetErrorString(s)));
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<DeviceSite>& site = devices_[device];
  if (!site) {  // Executions on one device are sequential; this is the first.
    site = std::make_unique<DeviceSite>();
    site->device = device;
    site->rank = ids[0];
    site->group = ids[1];
  }
  return site.get();
}

StateType SiteStateType() {
  return {"jax_hybridep_cuda_site_state", &SiteState::id, &kSiteStateInfo};
}

XLA_FFI_Handler* SiteStateInstantiate() { return kSiteStateInstantiate; }

}  // namespace jax_hybridep
