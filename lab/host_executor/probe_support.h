// What the probe kernels' launchers share (probes.cu, probes_memory.cu): device buffers, their
// results fetched back, launch statuses checked, every virtual GPU waited for. Compiled with the
// probes, against the executor's CUDA.
#ifndef JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PROBE_SUPPORT_H_
#define JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PROBE_SUPPORT_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace jax_hybridep::host {

// n elements of device memory on the current GPU, every byte `fill`.
template <typename T>
T* Device(size_t n, int fill = 0) {
  void* p = nullptr;
  if (cudaMalloc(&p, n * sizeof(T)) != cudaSuccess) throw std::runtime_error("cudaMalloc");
  cudaMemset(p, fill, n * sizeof(T));
  return static_cast<T*>(p);
}

template <typename T>
std::vector<int64_t> Fetch(const T* device, size_t n) {
  std::vector<T> out(n);
  cudaMemcpy(out.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost);
  return std::vector<int64_t>(out.begin(), out.end());
}

inline void Check(cudaError_t s, const char* what) {
  if (s != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(s));
}

// Waits for every virtual GPU (a report is thrown), GPU 0 current after.
inline void Sync() {
  for (int g = 0, n = 0; cudaGetDeviceCount(&n) == cudaSuccess && g < n; ++g) {
    cudaSetDevice(g);
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  cudaSetDevice(0);
}

}  // namespace jax_hybridep::host

#endif  // JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PROBE_SUPPORT_H_
