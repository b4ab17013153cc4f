// Shared by the test module's CUDA hooks (self-tests and benchmarks): a device count that is 0
// without a driver, and a GPU session owning a stream and its allocations; the numpy-array helpers
// are lab/native/array_hooks.h's. Plain C++ against the CUDA runtime API.
#ifndef JAX_HYBRIDEP_LAB_NATIVE_CUDA_HOOK_SUPPORT_H_
#define JAX_HYBRIDEP_LAB_NATIVE_CUDA_HOOK_SUPPORT_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "lab/native/array_hooks.h"

namespace jax_hybridep {

// 0 when there is no usable GPU: with static cudart and no libcuda the call fails, and that must
// read as "no device", not raise.
inline int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // Clear the error so later calls do not report it.
    return 0;
  }
  return count;
}

inline void CheckCuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(status));
  }
}

// One self-test's resources on one GPU (`device`, or the current one): a stream and every
// allocation, all released together.
class GpuSession {
 public:
  explicit GpuSession(int device = -1) {
    if (CudaDeviceCount() == 0) throw std::runtime_error("no CUDA device available");
    if (device >= 0) CheckCuda(cudaSetDevice(device), "cudaSetDevice");
    CheckCuda(cudaGetDevice(&device_), "cudaGetDevice");
    CheckCuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  GpuSession(const GpuSession&) = delete;
  GpuSession& operator=(const GpuSession&) = delete;
  ~GpuSession() {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    for (void* ptr : allocations_) cudaFree(ptr);
    cudaStreamDestroy(stream_);
  }

  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  // Makes this session's GPU the current one (for launches on its stream).
  void Use() const { CheckCuda(cudaSetDevice(device_), "cudaSetDevice"); }

  // n elements as cudaMalloc leaves them: for what the kernels must write themselves (an XLA
  // output, a kernel's scratch). Whatever a GPU held there before; under the host executor
  // poison that it reports reading (docs/host_executor.md, initcheck).
  template <typename T>
  T* Uninitialised(size_t n) {
    Use();
    void* ptr = nullptr;
    CheckCuda(cudaMalloc(&ptr, std::max<size_t>(n * sizeof(T), 1)), "cudaMalloc");
    allocations_.push_back(ptr);
    return static_cast<T*>(ptr);
  }

  // n zero-filled elements.
  template <typename T>
  T* Zeros(size_t n) {
    T* ptr = Uninitialised<T>(n);
    CheckCuda(cudaMemsetAsync(ptr, 0, n * sizeof(T), stream_), "cudaMemsetAsync");
    return ptr;
  }

  template <typename T>
  T* Upload(const T* values, size_t n) {
    T* ptr = Uninitialised<T>(n);
    CheckCuda(cudaMemcpyAsync(ptr, values, n * sizeof(T), cudaMemcpyHostToDevice, stream_),
              "cudaMemcpyAsync");
    return ptr;
  }

  // Waits for the stream (surfacing any kernel fault) and copies n elements back.
  template <typename T>
  std::vector<T> Download(const T* device, size_t n) {
    Use();
    std::vector<T> out(n);
    CheckCuda(cudaMemcpyAsync(out.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost, stream_),
              "cudaMemcpyAsync");
    CheckCuda(cudaStreamSynchronize(stream_), "kernel");
    return out;
  }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocations_;
};

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_CUDA_HOOK_SUPPORT_H_
