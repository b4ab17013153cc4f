// Helpers of the CUDA launchers (the C++ that enqueues kernels): a kernel launch that both nvcc and
// the host executor compile (docs/host_executor.md), and a kernel template instantiated per row
// dtype.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_LAUNCH_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <type_traits>
#include <utility>

#include "xla_ffi/common/numeric.h"

namespace jax_hybridep {

// kernel<<<grid, block, smem, stream>>>(args...), and the launch's status. The host executor
// (-DJAX_HYBRIDEP_HOST_EXECUTOR) runs the same kernel on its virtual GPUs instead.
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, Args&&... args) {
#if defined(JAX_HYBRIDEP_HOST_EXECUTOR)
  return host::LaunchKernel(kernel, grid, block, smem, stream, std::forward<Args>(args)...);
#else
  // A header: clang-format would split the launch's >>> token.
  // clang-format off
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
  // clang-format on
  return cudaGetLastError();
#endif
}

// Calls launch(std::integral_constant<Dtype, dtype>()) so the launch picks the kernel instance of
// `dtype`; returns the launch status.
template <typename Launch>
cudaError_t ByDtype(Dtype dtype, Launch&& launch) {
  switch (dtype) {
    case Dtype::kF32:
      launch(std::integral_constant<Dtype, Dtype::kF32>());
      break;
    case Dtype::kBF16:
      launch(std::integral_constant<Dtype, Dtype::kBF16>());
      break;
    case Dtype::kF16:
      launch(std::integral_constant<Dtype, Dtype::kF16>());
      break;
  }
  return cudaGetLastError();
}

// Calls launch(std::true_type()) or launch(std::false_type()): the kernel instance for rows of
// whole aligned 16-byte words, or the other.
template <typename Launch>
void ByWidth(bool wide, Launch&& launch) {
  if (wide) {
    launch(std::true_type());
  } else {
    launch(std::false_type());
  }
}

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_LAUNCH_H_
