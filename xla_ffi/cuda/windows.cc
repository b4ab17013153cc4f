// The process-wide registry of registered windows (windows.h).
#include "xla_ffi/cuda/windows.h"

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace jax_hybridep {
namespace {

Status Failure(const std::string& message) {
  return Status{Status::Code::kFailedPrecondition, "jax_hybridep: " + message};
}

Status CudaFailure(cudaError_t status, const std::string& what) {
  cudaGetLastError();  // Clear it so later calls do not report it again.
  return Failure(what + " failed: " + cudaGetErrorString(status));
}

struct Group {
  int64_t ranks = 0;
  std::vector<char*> bases;  // per rank, its window (device memory on its device)
  std::vector<int> devices;  // per rank
  std::vector<RankWindow> views;
  int64_t joined = 0;
  std::condition_variable all_joined;
};

using KeyTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;

struct Registry {
  std::mutex mu;
  std::map<KeyTuple, std::unique_ptr<Group>> groups;
};

Registry& GetRegistry() {
  static auto* registry = new Registry();  // Never destroyed: ReleaseWindows frees the memory.
  return *registry;
}

KeyTuple Tuple(const WindowKey& key) {
  const WindowGeometry& g = key.geometry;
  return {key.group, g.ranks, g.tokens, g.k, g.row_bytes};
}

Status Allocate(const WindowGeometry& geometry, int device, char** base, RankWindow* view) {
  cudaError_t s = cudaSetDevice(device);
  if (s != cudaSuccess) return CudaFailure(s, "cudaSetDevice");
  const size_t bytes = WindowBytes(geometry);
  void* ptr = nullptr;
  s = cudaMalloc(&ptr, bytes);
  if (s != cudaSuccess) {
    std::ostringstream msg;
    msg << "allocating a " << bytes << "-byte exchange window on GPU " << device
        << " (R=" << geometry.ranks << ", T=" << geometry.tokens << ", K=" << geometry.k
        << ", row bytes=" << geometry.row_bytes
        << "; XLA may hold most GPU memory: lower XLA_PYTHON_CLIENT_MEM_FRACTION)";
    return CudaFailure(s, msg.str());
  }
  *base = static_cast<char*>(ptr);
  s = cudaMemset(ptr, 0, bytes);  // Flags start at generation 0.
  if (s != cudaSuccess) return CudaFailure(s, "cudaMemset");
  void* host = nullptr;
  s = cudaHostAlloc(&host, sizeof(TransportError), cudaHostAllocMapped | cudaHostAllocPortable);
  if (s != cudaSuccess) return CudaFailure(s, "cudaHostAlloc");
  *static_cast<TransportError*>(host) = TransportError{};
  void* mapped = nullptr;
  s = cudaHostGetDevicePointer(&mapped, host, 0);
  if (s != cudaSuccess) return CudaFailure(s, "cudaHostGetDevicePointer");
  view->error_host = static_cast<TransportError*>(host);
  view->error_device = static_cast<TransportError*>(mapped);
  view->device = device;
  return Status::Ok();
}

// Maps every peer's window into rank's device: peer access, then the device array of views.
Status MapPeers(const WindowGeometry& geometry, Group& group, int32_t rank) {
  const int device = group.devices[rank];
  cudaError_t s = cudaSetDevice(device);
  if (s != cudaSuccess) return CudaFailure(s, "cudaSetDevice");
  std::vector<Window> windows(group.ranks);
  for (int64_t r = 0; r < group.ranks; ++r) {
    const int peer = group.devices[r];
    if (peer != device) {
      int can = 0;
      s = cudaDeviceCanAccessPeer(&can, device, peer);
      if (s != cudaSuccess) return CudaFailure(s, "cudaDeviceCanAccessPeer");
      if (!can) {
        std::ostringstream msg;
        msg << "GPU " << device << " (EP rank " << rank << ") cannot access the memory of GPU "
            << peer << " (EP rank " << r << "): the ffi backend's GPU transport needs every GPU of "
            << "an EP group in one process to be a peer of the others (NVLink or PCIe P2P); use "
            << "backend='xla'";
        return Failure(msg.str());
      }
      s = cudaDeviceEnablePeerAccess(peer, 0);
      if (s == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
      } else if (s != cudaSuccess) {
        return CudaFailure(s, "cudaDeviceEnablePeerAccess");
      }
    }
    windows[r] = CarveWindow(group.bases[r], geometry);
  }
  void* array = nullptr;
  s = cudaMalloc(&array, sizeof(Window) * windows.size());
  if (s != cudaSuccess) return CudaFailure(s, "cudaMalloc");
  s = cudaMemcpy(array, windows.data(), sizeof(Window) * windows.size(), cudaMemcpyHostToDevice);
  if (s != cudaSuccess) return CudaFailure(s, "cudaMemcpy");
  group.views[rank].windows = static_cast<const Window*>(array);
  return Status::Ok();
}

}  // namespace

Status AcquireWindow(const WindowKey& key, int32_t rank, int device,
                     std::chrono::milliseconds timeout, RankWindow** out) {
  const WindowGeometry& geometry = key.geometry;
  if (geometry.ranks > kMaxWindowRanks) {
    std::ostringstream msg;
    msg << "an EP group of " << geometry.ranks << " GPUs in one process exceeds the transport's "
        << kMaxWindowRanks;
    return Failure(msg.str());
  }
  Registry& registry = GetRegistry();
  std::unique_lock<std::mutex> lock(registry.mu);
  std::unique_ptr<Group>& slot = registry.groups[Tuple(key)];
  if (!slot) {
    slot = std::make_unique<Group>();
    slot->ranks = geometry.ranks;
    slot->bases.assign(geometry.ranks, nullptr);
    slot->devices.assign(geometry.ranks, -1);
    slot->views.resize(geometry.ranks);
  }
  Group& group = *slot;
  RankWindow& view = group.views[rank];
  if (view.windows != nullptr) {
    *out = &view;
    return Status::Ok();
  }
  if (group.bases[rank] == nullptr) {
    view.rank = rank;
    if (Status s = Allocate(geometry, device, &group.bases[rank], &view); !s.ok()) return s;
    group.devices[rank] = device;
    ++group.joined;
    group.all_joined.notify_all();
  }
  if (!group.all_joined.wait_for(lock, timeout, [&] { return group.joined == group.ranks; })) {
    std::ostringstream msg;
    msg << "EP rank " << rank << " waited " << timeout.count() << " ms for the other ranks to "
        << "register their exchange windows (" << group.joined << " of " << group.ranks
        << " did); a device of the group never ran this exchange";
    return Status{Status::Code::kDeadlineExceeded, "jax_hybridep: " + msg.str()};
  }
  if (Status s = MapPeers(geometry, group, rank); !s.ok()) return s;
  *out = &view;
  return Status::Ok();
}

Status WindowError(const RankWindow& window) {
  const volatile TransportError* e = window.error_host;
  if (e == nullptr || e->code == 0) return Status::Ok();
  std::ostringstream msg;
  msg << "jax_hybridep: GPU exchange timed out: EP rank " << e->rank << " waited for EP rank "
      << e->peer << " (its send block " << e->block << ") in exchange " << e->generation
      << " of this window; the peers no longer agree on the exchange sequence, restart the "
      << "process (DispatchConfig.timeout_s sets the limit)";
  return Status{Status::Code::kDeadlineExceeded, msg.str()};
}

std::string FirstWindowError() {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  for (const auto& [key, group] : registry.groups) {
    for (const RankWindow& view : group->views) {
      Status s = WindowError(view);
      if (!s.ok()) return s.message;
    }
  }
  return "";
}

void ReleaseWindows() {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  for (auto& [key, group] : registry.groups) {
    for (int64_t r = 0; r < group->ranks; ++r) {
      if (group->bases[r] == nullptr) continue;
      cudaSetDevice(group->devices[r]);
      cudaDeviceSynchronize();
      cudaFree(group->bases[r]);
      cudaFree(const_cast<Window*>(group->views[r].windows));
      cudaFreeHost(group->views[r].error_host);
    }
  }
  registry.groups.clear();
  cudaGetLastError();
}

}  // namespace jax_hybridep
