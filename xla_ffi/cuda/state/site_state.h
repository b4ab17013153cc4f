// What each CUDA call site keeps between its executions, owned by the executable (XLA's stateful
// FFI): XLA runs the instantiate stage once per custom call of an executable, keeps the SiteState
// it returns beside that call, and deletes it with the executable (the type registered with its
// deleter, SiteStateType()). Nothing outlives the programs that use it, however often a model is
// retraced.
//
// One executable may run on several GPUs of the process at once (one program, many devices), so a
// SiteState holds one DeviceSite per device, made on that device's first execution: the shard's
// rank and group (read once from their operands), the window it exchanges through
// (window_registry.h, kept by the process-wide registry, shared by every site of a geometry) and
// the layout's device scratch.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_STATE_SITE_STATE_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_STATE_SITE_STATE_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda/state/window_registry.h"

namespace jax_hybridep {

// Device memory of one site on one device, freed with it.
class DeviceScratch {
 public:
  DeviceScratch() = default;
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() { Release(); }

  // Frees every block (cudaFree synchronises: nothing of the site is still running after).
  void Release();

  template <typename T>
  cudaError_t Allocate(size_t n, T** out) {
    void* p = nullptr;
    const cudaError_t s = cudaMalloc(&p, n * sizeof(T) > 0 ? n * sizeof(T) : 1);
    if (s != cudaSuccess) return s;
    blocks_.push_back(p);
    *out = static_cast<T*>(p);
    return cudaSuccess;
  }

 private:
  std::vector<void*> blocks_;
};

// One call site on one device.
struct DeviceSite {
  int32_t device = 0;
  int32_t rank = 0, group = 0;
  RankWindow* window = nullptr;  // exchanges: acquired on the first
  // Layout: the placement on the device and the scratch of its steps.
  int64_t *expert_rank = nullptr, *expert_slot = nullptr;
  int32_t *all_counts = nullptr, *keep_limit = nullptr, *group_offset = nullptr;
  int32_t* all_group_sizes = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  DeviceScratch scratch;

  ~DeviceSite();  // frees the scratch on its own device
};

class SiteState {
 public:
  static xla::ffi::TypeId id;  // assigned when Python registers the type (SiteStateType)

  SiteState();
  SiteState(const SiteState&) = delete;
  SiteState& operator=(const SiteState&) = delete;
  virtual ~SiteState();

  // The site on `device`, made on first use with this shard's rank and group read from their
  // operands (a synchronous copy, once per site and device). The copy waits for this rank's
  // earlier exchanges, which may wait for peers at their own first calls: no lock is held then.
  xla::ffi::ErrorOr<DeviceSite*> OnDevice(int32_t device, cudaStream_t stream,
                                          xla::ffi::Buffer<xla::ffi::S32> rank,
                                          xla::ffi::Buffer<xla::ffi::S32> group);

 private:
  std::mutex mu_;
  std::map<int32_t, std::unique_ptr<DeviceSite>> devices_;
};

// The type registration of SiteState: its id and its deleter.
struct StateType {
  const char* name;
  xla::ffi::TypeId* id;
  const xla::ffi::TypeInfo* info;
};
StateType SiteStateType();

// The instantiate stage every CUDA handler binds: a new, empty SiteState.
XLA_FFI_Handler* SiteStateInstantiate();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_STATE_SITE_STATE_H_
