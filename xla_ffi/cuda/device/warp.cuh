// Warp-level helpers of the kernels: the lane, and reductions over a warp's lanes by shuffles
// (which exchange registers and order no memory: a __syncwarp does).
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_WARP_CUH_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_WARP_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_hybridep {
namespace device {

constexpr unsigned kAllLanes = 0xffffffffu;

__device__ __forceinline__ int Lane() { return static_cast<int>(threadIdx.x % 32); }

// The maximum of v over the lanes of a warp (every lane gets it).
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(kAllLanes, v, offset));
  return v;
}

// OR of v over the lanes of a warp.
__device__ __forceinline__ uint32_t WarpOr(uint32_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v |= __shfl_xor_sync(kAllLanes, v, offset);
  return v;
}

}  // namespace device
}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_WARP_CUH_
