// Shared by the native module's CUDA hooks (self-tests and benchmarks): host numpy arrays in and
// out, a GPU session owning a stream and its allocations, and argument checks that raise
// ValueError. Plain C++ against the CUDA runtime API.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_HOOK_SUPPORT_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_HOOK_SUPPORT_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "xla_ffi/numeric.h"

namespace jax_hybridep {

namespace nb = nanobind;

template <typename T>
using HostArray = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;

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

// One self-test's GPU resources: a stream and every allocation, all released together.
class GpuSession {
 public:
  GpuSession() {
    if (CudaDeviceCount() == 0) throw std::runtime_error("no CUDA device available");
    CheckCuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  GpuSession(const GpuSession&) = delete;
  GpuSession& operator=(const GpuSession&) = delete;
  ~GpuSession() {
    cudaStreamSynchronize(stream_);
    for (void* ptr : allocations_) cudaFree(ptr);
    cudaStreamDestroy(stream_);
  }

  cudaStream_t stream() const { return stream_; }

  // n zero-filled elements.
  template <typename T>
  T* Zeros(size_t n) {
    void* ptr = nullptr;
    CheckCuda(cudaMalloc(&ptr, std::max<size_t>(n * sizeof(T), 1)), "cudaMalloc");
    allocations_.push_back(ptr);
    CheckCuda(cudaMemsetAsync(ptr, 0, n * sizeof(T), stream_), "cudaMemsetAsync");
    return static_cast<T*>(ptr);
  }

  template <typename T>
  T* Upload(const T* host, size_t n) {
    T* ptr = Zeros<T>(n);
    CheckCuda(cudaMemcpyAsync(ptr, host, n * sizeof(T), cudaMemcpyHostToDevice, stream_),
              "cudaMemcpyAsync");
    return ptr;
  }

  // Waits for the stream (surfacing any kernel fault) and copies n elements back.
  template <typename T>
  std::vector<T> Download(const T* device, size_t n) {
    std::vector<T> host(n);
    CheckCuda(cudaMemcpyAsync(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost, stream_),
              "cudaMemcpyAsync");
    CheckCuda(cudaStreamSynchronize(stream_), "kernel");
    return host;
  }

 private:
  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocations_;
};

template <typename T>
inline nb::object ToNumpy(std::vector<T> values, std::vector<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::cast(nb::ndarray<nb::numpy, T>(owned->data(), shape.size(), shape.data(), owner));
}

inline void Require(bool ok, const std::string& message) {
  if (!ok) throw nb::value_error(message.c_str());
}

template <typename T>
inline void RequireShape(const HostArray<T>& a, const char* name, std::vector<int64_t> shape) {
  bool ok = a.ndim() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = static_cast<int64_t>(a.shape(i)) == shape[i];
  std::string want, got;
  for (int64_t d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
  for (size_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
  Require(ok, std::string(name) + ": expected shape (" + want + ") but got (" + got + ")");
}

inline void RequireRange(const int32_t* values, size_t n, int64_t limit, const char* name) {
  for (size_t i = 0; i < n; ++i) {
    Require(values[i] >= -1 && values[i] < limit,
            std::string(name) + " has " + std::to_string(values[i]) + ", outside [-1, " +
                std::to_string(limit) + ")");
  }
}

inline Dtype ParseDtype(const std::string& name) {
  if (name == "float32") return Dtype::kF32;
  if (name == "bfloat16") return Dtype::kBF16;
  if (name == "float16") return Dtype::kF16;
  throw nb::value_error("dtype must be 'float32', 'bfloat16' or 'float16'");
}

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_HOOK_SUPPORT_H_
