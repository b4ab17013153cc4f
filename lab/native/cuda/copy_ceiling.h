// The copy-ceiling kernels of the GPU checks (copy_ceiling.cu): what one SM moves by 16-byte LSU
// loads and stores against the bulk-copy engine, measured beside the transport in one lease.
#ifndef JAX_HYBRIDEP_LAB_NATIVE_CUDA_COPY_CEILING_H_
#define JAX_HYBRIDEP_LAB_NATIVE_CUDA_COPY_CEILING_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_hybridep {

enum class CopyPath { kLsu, kBulk };

// Copies `bytes` (a multiple of 16, 16-byte aligned) from src to dst with `blocks` blocks.
cudaError_t LaunchCopyCeiling(CopyPath path, const char* src, char* dst, int64_t bytes, int blocks,
                              cudaStream_t stream);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_CUDA_COPY_CEILING_H_
