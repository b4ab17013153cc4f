// The process-wide registry of registered windows (window_registry.h).
#include "xla_ffi/cuda/state/window_registry.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "xla_ffi/cuda/state/window_regions.h"

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

using KeyTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, bool>;

struct Registry {
  std::mutex mu;
  std::map<KeyTuple, std::unique_ptr<Group>> groups;  // never erased: views outlive release
  KvExchange kv;
};

Registry& GetRegistry() {
  static auto* registry = new Registry();  // Never destroyed: ReleaseWindows frees the memory.
  return *registry;
}

KeyTuple Tuple(const WindowKey& key) {
  const WindowGeometry& g = key.geometry;
  return {key.group, g.ranks, g.items, g.row_bytes, key.multi_process};
}

// Setup copies run on a private non-blocking stream: a synchronous call on the legacy default
// stream could wait for this device's in-flight exchanges, which may wait for peers that are
// themselves still setting up.
class SetupStream {
 public:
  SetupStream() { status_ = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }
  ~SetupStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaError_t status() const { return status_; }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
  cudaError_t status_;
};

// The owner's allocations for one window, released unless kept.
struct Allocation {
  char* base = nullptr;
  TransportError* record = nullptr;  // the mapped error record, as the CPU reads it
  TransportError* mapped = nullptr;  // the same, as the kernels address it
  ~Allocation() {
    if (base != nullptr) cudaFree(base);
    if (record != nullptr) cudaFreeHost(record);
  }
};

Status Allocate(const WindowKey& key, int device, Allocation* a) {
  const WindowGeometry& geometry = key.geometry;
  cudaError_t s = cudaSetDevice(device);
  if (s != cudaSuccess) return CudaFailure(s, "cudaSetDevice");
  const size_t bytes = WindowBytes(geometry);
  void* ptr = nullptr;
  s = cudaMalloc(&ptr, bytes);
  if (s != cudaSuccess) {
    std::ostringstream msg;
    msg << "allocating a " << bytes << "-byte exchange window on GPU " << device
        << " (GPUs=" << geometry.ranks << ", items=" << geometry.items
        << ", row bytes=" << geometry.row_bytes
        << "; XLA may hold most GPU memory: lower XLA_PYTHON_CLIENT_MEM_FRACTION)";
    return CudaFailure(s, msg.str());
  }
  a->base = static_cast<char*>(ptr);
  void* record = nullptr;
  s = cudaHostAlloc(&record, sizeof(TransportError), cudaHostAllocMapped | cudaHostAllocPortable);
  if (s != cudaSuccess) return CudaFailure(s, "cudaHostAlloc");
  a->record = static_cast<TransportError*>(record);
  *a->record = TransportError{};
  void* mapped = nullptr;
  s = cudaHostGetDevicePointer(&mapped, record, 0);
  if (s != cudaSuccess) return CudaFailure(s, "cudaHostGetDevicePointer");
  a->mapped = static_cast<TransportError*>(mapped);
  SetupStream stream;
  s = stream.status();
  if (s == cudaSuccess) s = cudaMemsetAsync(ptr, 0, bytes, stream.get());  // Flags start at 0.
  if (s == cudaSuccess) s = cudaStreamSynchronize(stream.get());
  return s == cudaSuccess ? Status::Ok() : CudaFailure(s, "clearing the window");
}

// Enables `rank`'s device to reach the windows of the ranks in this process (peer access).
Status EnablePeers(const std::vector<int>& devices, int32_t rank) {
  const int device = devices[rank];
  cudaError_t s = cudaSetDevice(device);
  if (s != cudaSuccess) return CudaFailure(s, "cudaSetDevice");
  for (size_t r = 0; r < devices.size(); ++r) {
    const int peer = devices[r];
    if (peer < 0 || peer == device) continue;  // < 0: another process's window, opened by IPC
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
  return Status::Ok();
}

// What a rank publishes for ranks in other processes: its process, GPU and window handle.
struct IpcEntry {
  uint64_t process;  // ProcessToken(): pids repeat across containers and nodes
  int64_t pid;       // for messages
  int32_t device;
  cudaIpcMemHandle_t handle;
};

// A random id drawn once per process.
uint64_t ProcessToken() {
  static const uint64_t token = [] {
    std::random_device random;
    return (static_cast<uint64_t>(random()) << 32) ^ random() ^ static_cast<uint64_t>(getpid());
  }();
  return token;
}

std::string KvPrefix(const WindowKey& key) {
  const WindowGeometry& g = key.geometry;
  std::ostringstream out;
  out << "jax_hybridep/window/g" << key.group << "/S" << g.ranks << "/M" << g.items << "/b"
      << g.row_bytes;
  return out.str();
}

// Publishes this rank's window and opens those of the ranks in other processes: opened[r] is the
// mapping of rank r's window, or null for ranks of this process. Every rank publishes only after
// it registered in its process's group, so once all have published, this process's ranks are all
// in the group.
Status ExchangeIpc(const WindowKey& key, const KvExchange& kv, int32_t rank, int device,
                   char* own_base, int64_t timeout_ms, std::vector<char*>* opened) {
  if (!kv) {
    return Failure(
        "the EP group spans processes but no key-value exchange is set (initialise "
        "jax.distributed before the first exchange)");
  }
  cudaError_t s = cudaSetDevice(device);
  IpcEntry mine{ProcessToken(), static_cast<int64_t>(getpid()), device, {}};
  if (s == cudaSuccess) s = cudaIpcGetMemHandle(&mine.handle, own_base);
  if (s != cudaSuccess) return CudaFailure(s, "cudaIpcGetMemHandle");
  std::vector<std::string> all;
  const std::string packed(reinterpret_cast<const char*>(&mine), sizeof(mine));
  if (Status st = kv(KvPrefix(key), rank, packed, key.geometry.ranks, timeout_ms, &all); !st.ok()) {
    return st;
  }
  opened->assign(key.geometry.ranks, nullptr);
  auto fail = [&](Status status) {  // Nothing half-opened stays behind.
    for (char* p : *opened) {
      if (p != nullptr) cudaIpcCloseMemHandle(p);
    }
    opened->assign(key.geometry.ranks, nullptr);
    return status;
  };
  s = cudaSetDevice(device);  // The exchange ran Python on this thread.
  if (s != cudaSuccess) return fail(CudaFailure(s, "cudaSetDevice"));
  for (int64_t r = 0; r < key.geometry.ranks; ++r) {
    if (r >= static_cast<int64_t>(all.size()) || all[r].size() != sizeof(IpcEntry)) {
      return fail(Failure("malformed window handle from EP rank " + std::to_string(r)));
    }
    IpcEntry theirs;
    std::memcpy(&theirs, all[r].data(), sizeof(theirs));
    if (theirs.process == mine.process) continue;
    void* ptr = nullptr;
    s = cudaIpcOpenMemHandle(&ptr, theirs.handle, cudaIpcMemLazyEnablePeerAccess);
    if (s != cudaSuccess) {
      std::ostringstream msg;
      msg << "EP rank " << rank << " (GPU " << device << ") opening the window of EP rank " << r
          << " (process " << theirs.pid << ", GPU " << theirs.device
          << ") by CUDA IPC (the GPUs of a one-level EP group must share a node)";
      return fail(CudaFailure(s, msg.str()));
    }
    (*opened)[r] = static_cast<char*>(ptr);
  }
  return Status::Ok();
}

// Every rank's window base and GPU once all ranks of an in-process group have registered.
Status InProcessPeers(int32_t rank, Group* group, std::chrono::milliseconds timeout,
                      std::vector<char*>* bases, std::vector<int>* devices) {
  Registry& registry = GetRegistry();
  std::unique_lock<std::mutex> lock(registry.mu);
  if (!group->all_joined.wait_for(lock, timeout, [&] { return group->joined == group->ranks; })) {
    std::ostringstream msg;
    msg << "EP rank " << rank << " waited " << timeout.count() << " ms for the other ranks to "
        << "register their exchange windows (" << group->joined << " of " << group->ranks
        << " did); a device of the group never ran this exchange";
    return Status{Status::Code::kDeadlineExceeded, "jax_hybridep: " + msg.str()};
  }
  *bases = group->bases;
  *devices = group->devices;
  return Status::Ok();
}

// The same when some ranks live in other processes: their windows come through the key-value
// exchange and are opened by CUDA IPC (GPU -1: peer access comes with the mapping).
Status IpcPeers(const WindowKey& key, int32_t rank, int device, Group* group,
                std::chrono::milliseconds timeout, std::vector<char*>* bases,
                std::vector<int>* devices) {
  Registry& registry = GetRegistry();
  KvExchange kv;
  char* own = nullptr;
  {
    std::lock_guard<std::mutex> lock(registry.mu);
    kv = registry.kv;
    own = group->bases[rank];
  }
  std::vector<char*> opened;
  if (Status s = ExchangeIpc(key, kv, rank, device, own, timeout.count(), &opened); !s.ok()) {
    return s;
  }
  std::lock_guard<std::mutex> lock(registry.mu);
  for (char* p : opened) {
    if (p != nullptr) group->views[rank].opened.push_back(p);
  }
  *bases = group->bases;
  *devices = group->devices;
  for (int64_t r = 0; r < group->ranks; ++r) {
    if (opened[r] != nullptr) {
      (*bases)[r] = opened[r];
      (*devices)[r] = -1;
    } else if ((*bases)[r] == nullptr) {
      return Failure("EP rank " + std::to_string(r) +
                     " published its window but is not registered in this process");
    }
  }
  return Status::Ok();
}

}  // namespace

void SetKvExchange(KvExchange exchange) {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  registry.kv = std::move(exchange);
}

Status AcquireWindow(const WindowKey& key, int32_t rank, int device,
                     std::chrono::milliseconds timeout, RankWindow** out) {
  const WindowGeometry& geometry = key.geometry;
  if (geometry.ranks < 1 || geometry.ranks > kMaxWindowRanks || rank < 0 ||
      rank >= geometry.ranks) {
    std::ostringstream msg;
    msg << "EP rank " << rank << " of a group of " << geometry.ranks << " GPUs: the transport "
        << "takes groups of 1 to " << kMaxWindowRanks << " GPUs in one process";
    return Failure(msg.str());
  }
  Registry& registry = GetRegistry();
  Group* group = nullptr;
  bool allocate = false;
  {
    std::lock_guard<std::mutex> lock(registry.mu);
    std::unique_ptr<Group>& slot = registry.groups[Tuple(key)];
    if (!slot) {
      slot = std::make_unique<Group>();
      slot->ranks = geometry.ranks;
      slot->bases.assign(geometry.ranks, nullptr);
      slot->devices.assign(geometry.ranks, -1);
      slot->views.resize(geometry.ranks);
    }
    group = slot.get();
    RankWindow& view = group->views[rank];
    if (!view.bases.empty() || view.released) {
      *out = &view;
      return Status::Ok();
    }
    allocate = group->bases[rank] == nullptr;
  }
  if (allocate) {
    Allocation a;
    if (Status s = Allocate(key, device, &a); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(registry.mu);
    RankWindow& view = group->views[rank];
    view.error_cpu = a.record;
    view.error_device = a.mapped;
    group->bases[rank] = a.base;
    group->devices[rank] = device;
    a.base = nullptr;  // Kept: the group owns them now.
    a.record = nullptr;
    ++group->joined;
    group->all_joined.notify_all();
  }
  std::vector<char*> bases;
  std::vector<int> devices;
  const Status peers = key.multi_process
                           ? IpcPeers(key, rank, device, group, timeout, &bases, &devices)
                           : InProcessPeers(rank, group, timeout, &bases, &devices);
  if (!peers.ok()) return peers;
  if (Status s = EnablePeers(devices, rank); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(registry.mu);
  group->views[rank].bases = bases;
  *out = &group->views[rank];
  return Status::Ok();
}

Status WindowError(const RankWindow& window) {
  if (window.released) {
    return Failure("the GPU exchange windows were released (process exit); no more exchanges");
  }
  const volatile TransportError* e = window.error_cpu;
  if (e == nullptr || e->code == 0) return Status::Ok();
  std::ostringstream msg;
  if (e->code == kWaitMismatch) {
    msg << "jax_hybridep: GPU exchange mismatch: EP rank " << e->rank << " waiting in its exchange "
        << e->generation << " (flag tag " << e->expected << ") found the flag of EP rank "
        << e->peer << "'s send block " << e->block << " tagged " << e->seen << " (exchange "
        << (e->seen >> 32) << ", call site " << (e->seen & 0xffffffffu) << "): the ranks ran "
        << "different exchanges on one window; restart the process";
    return Status{Status::Code::kFailedPrecondition, msg.str()};
  }
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
      if (view.released) continue;
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
      RankWindow& view = group->views[r];
      if (group->bases[r] != nullptr) {
        cudaSetDevice(group->devices[r]);
        cudaDeviceSynchronize();
        for (char* p : view.opened) cudaIpcCloseMemHandle(p);
        cudaFree(group->bases[r]);
        cudaFreeHost(view.error_cpu);
      }
      group->bases[r] = nullptr;
      view.bases.clear();
      view.opened.clear();
      view.error_cpu = view.error_device = nullptr;
      view.released = true;
    }
  }
  cudaGetLastError();
}

}  // namespace jax_hybridep
