// Registered windows (window_regions.h) of the GPUs of one process: allocated once per (EP group,
// geometry) and device, peer pointers exchanged once (through this registry, or a key-value
// exchange across processes), reused for every exchange behind the flags, freed by ReleaseWindows
// (Python calls it at exit).
//
// One process driving several GPUs reaches its peers' windows through peer access (NVLink or PCIe
// P2P). When the group spans processes (one process per GPU, on one node), every rank publishes
// a random process token, its GPU and a CUDA IPC handle of its window through a key-value exchange
// (the jax.distributed store, set by the module) and opens the handles of the ranks in other
// processes. Plain C++ against the CUDA runtime API.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_STATE_WINDOW_REGISTRY_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_STATE_WINDOW_REGISTRY_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "xla_ffi/common/rendezvous.h"
#include "xla_ffi/cuda/state/window_regions.h"

namespace jax_hybridep {

struct WindowKey {
  int64_t group;  // EP-group id (several groups may share a process)
  WindowGeometry geometry;
  bool multi_process = false;  // some ranks live in other processes (CUDA IPC)
};

// Publishes `mine` for `rank` under `prefix` and returns the strings of all `count` ranks, in rank
// order, waiting up to `timeout_ms` for them.
using KvExchange =
    std::function<Status(const std::string& prefix, int32_t rank, const std::string& mine,
                         int64_t count, int64_t timeout_ms, std::vector<std::string>* all)>;

// Sets the exchange multi-process windows use (the module sets the jax.distributed one).
void SetKvExchange(KvExchange exchange);

// One rank's view of its window group.
struct RankWindow {
  std::vector<char*> bases;                // [R]: every rank's window base from this device
  TransportError* error_cpu = nullptr;     // the mapped record, as the handlers read it
  TransportError* error_device = nullptr;  // the same record as the kernels address it
  bool released = false;                   // ReleaseWindows freed it: exchanges on it fail
  std::vector<char*> opened;               // peers' windows this rank opened by CUDA IPC
};

// This rank's window of group `key` on `device`; the first call of each rank allocates it and
// waits (up to `timeout`) until every rank of the group has, then maps the peers' windows (ranks of
// other processes through CUDA IPC when key.multi_process). No lock is held while allocating,
// copying, exchanging handles or waiting for the device. Errors: a rank outside the group,
// peers that cannot reach each other, allocation failures, ranks that never came. The returned
// view lives as long as the process.
Status AcquireWindow(const WindowKey& key, int32_t rank, int device,
                     std::chrono::milliseconds timeout, RankWindow** out);

// Fails with the recorded device-side error of this rank's window, if any (a wait that timed
// out; the window is unusable afterwards: its ranks no longer agree on the generation), or when
// the window was released.
Status WindowError(const RankWindow& window);

// The first recorded error of any window of this process, or "" (hep.check_errors()).
std::string FirstWindowError();

// Frees every window's memory (after synchronising their devices); for process exit. The views
// stay valid and report `released`, so a later exchange fails with an error, never a dangling
// pointer.
void ReleaseWindows();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_STATE_WINDOW_REGISTRY_H_
