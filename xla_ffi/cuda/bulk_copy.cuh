// Hopper's bulk-copy pipeline (sm_90+): shared-memory mbarriers and the TMA engine's 1-D
// global -> shared copies (`cp.async.bulk`), for warp-specialised producer/consumer rings.
// Device code is compiled into every .cu file that includes it (whole-program CUDA, no device
// linking), so it has internal linkage here. Only compiled for __CUDA_ARCH__ >= 900.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_BULK_COPY_CUH_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_BULK_COPY_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
namespace jax_hybridep {
namespace {

__device__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ void BarrierInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" : : "r"(SharedAddress(bar)), "r"(count));
}

__device__ void BarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" : : "r"(SharedAddress(bar)) : "memory");
}

__device__ void BarrierExpectBytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :
               : "r"(SharedAddress(bar)), "r"(bytes)
               : "memory");
}

// Waits for the completion of the barrier's phase with parity `parity`.
__device__ void BarrierWait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(SharedAddress(bar)), "r"(parity)
        : "memory");
  }
}

__device__ void BulkLoad(void* smem, const void* global, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      :
      : "r"(SharedAddress(smem)), "l"(global), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}

}  // namespace
}  // namespace jax_hybridep
#endif

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_BULK_COPY_CUH_
