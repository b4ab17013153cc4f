// Probe kernels of the host executor's checks of global memory beyond races
// (tests/host_executor_test.py; init_tracking.h): reading bytes nothing wrote since their
// cudaMalloc (initcheck), initialised by each thing that writes memory, and a kernel reaching a
// peer GPU's memory with and without peer access. Compiled like the kernels.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "lab/host_executor/probe_support.h"
#include "lab/host_executor/probes.h"
#include "xla_ffi/cuda/device/launch.h"

namespace jax_hybridep::host {
namespace {

// out[i] = in[i] for `n` words; in and out on any GPU.
__global__ void CopyWords(const int* in, int* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = in[i];
}

// 8 words of fresh cudaMalloc'd memory read by a kernel; `how` they were initialised first: 0
// never, 1 a cudaMemset, 2 a kernel's stores, 3 a device-to-device copy of words never
// initialised, 4 a cudaMemset of all but the last word.
std::vector<int64_t> UninitialisedRead(int64_t how) {
  const dim3 one(1);
  int* in = nullptr;
  Check(cudaMalloc(&in, 32), "cudaMalloc");
  int* out = Device<int>(8);
  if (how == 1) Check(cudaMemset(in, 0, 32), "cudaMemset");
  if (how == 2) Check(LaunchKernel(&CopyWords, one, dim3(8), 0, nullptr, out, in, 8), "launch");
  if (how == 3) {
    int* never = nullptr;
    Check(cudaMalloc(&never, 32), "cudaMalloc");
    Check(cudaMemcpy(in, never, 32, cudaMemcpyDeviceToDevice), "cudaMemcpy");
  }
  if (how == 4) Check(cudaMemset(in, 0, 28), "cudaMemset");
  Check(LaunchKernel(&CopyWords, one, dim3(8), 0, nullptr, in, out, 8), "launch");
  Sync();
  return Fetch(out, 8);
}

// A kernel on GPU 1 copies 8 words of GPU 0's memory into its own; `enable`: GPU 1 enabled peer
// access to GPU 0 first (twice: the second call must say it already had).
std::vector<int64_t> PeerAccess(bool enable) {
  int* in = Device<int>(8, 1);
  cudaSetDevice(1);
  int* out = Device<int>(8);
  if (enable) {
    Check(cudaDeviceEnablePeerAccess(0, 0), "cudaDeviceEnablePeerAccess");
    if (cudaDeviceEnablePeerAccess(0, 0) != cudaErrorPeerAccessAlreadyEnabled) {
      throw std::runtime_error("a second cudaDeviceEnablePeerAccess(0) succeeded");
    }
    cudaGetLastError();
  }
  Check(LaunchKernel(&CopyWords, dim3(1), dim3(8), 0, nullptr, in, out, 8), "launch");
  Sync();
  return Fetch(out, 8);
}

}  // namespace

bool RunMemoryProbe(const std::string& name, int64_t arg, std::vector<int64_t>* out) {
  if (name == "uninitialised_read") {
    *out = UninitialisedRead(arg);
  } else if (name == "peer_access") {
    *out = PeerAccess(arg != 0);
  } else {
    return false;
  }
  return true;
}

}  // namespace jax_hybridep::host
