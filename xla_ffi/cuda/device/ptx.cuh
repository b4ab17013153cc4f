// Every PTX instruction the transport's kernels use, behind one function each, and the block's
// shared-memory declarations: inline assembly when nvcc compiles the kernels, a call of the host
// executor's model of the instruction when the C++ compiler builds them for the executor
// (-DJAX_HYBRIDEP_HOST_EXECUTOR; docs/host_executor.md). The kernels' logic is written once, above
// this layer.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_PTX_CUH_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_PTX_CUH_

#include <cuda_runtime.h>

#include <cstdint>

// Under the host executor, <cuda_runtime.h> above is the executor's own (first on its include
// path), and it declares the models called below: nothing here names the laboratory's files.

// __shared__ arrays, variables and the launch's dynamic shared memory. Under the host executor each
// is the block's own allocation in its bounds-checked arena (a pointer or a reference there).
#if defined(JAX_HYBRIDEP_HOST_EXECUTOR)
#define JAX_HYBRIDEP_SHARED_ARRAY(type, name, count, align) \
  type* const name =                                        \
      static_cast<type*>(::jax_hybridep::host::StaticShared(#name, sizeof(type) * (count), align))
#define JAX_HYBRIDEP_SHARED_VAR(type, name, align) \
  type& name = *static_cast<type*>(::jax_hybridep::host::StaticShared(#name, sizeof(type), align))
#define JAX_HYBRIDEP_DYNAMIC_SHARED(type, name, align) \
  type* const name = static_cast<type*>(::jax_hybridep::host::DynamicShared(align))
#else
#define JAX_HYBRIDEP_SHARED_ARRAY(type, name, count, align) \
  __shared__ __align__(align)                               \
  type name[count]
#define JAX_HYBRIDEP_SHARED_VAR(type, name, align) \
  __shared__ __align__(align)                      \
  type name
#define JAX_HYBRIDEP_DYNAMIC_SHARED(type, name, align) \
  extern __shared__ __align__(align)                   \
  type name[]
#endif

namespace jax_hybridep {
namespace ptx {

#if defined(JAX_HYBRIDEP_HOST_EXECUTOR)

inline uint64_t GlobalTimerNs() { return host::GlobalTimer(); }
inline uint64_t LoadAcquireSys(const uint64_t* flag) { return host::LoadAcquire(flag); }
inline void StoreReleaseSys(uint64_t* flag, uint64_t v) { host::StoreRelease(flag, v); }
inline void MbarrierInit(uint64_t* bar, uint32_t count) { host::MbarrierInit(bar, count); }
inline void FenceMbarrierInit() { host::FenceMbarrierInit(); }
inline void MbarrierArrive(uint64_t* bar) { host::MbarrierArrive(bar, 0); }
inline void MbarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  host::MbarrierArrive(bar, bytes);
}
inline bool MbarrierTryWaitParity(uint64_t* bar, uint32_t parity) {
  return host::MbarrierTryWaitParity(bar, parity);
}
inline void BulkLoadGlobalToShared(void* smem, const void* global, uint32_t bytes, uint64_t* bar) {
  host::BulkLoad(smem, global, bytes, bar);
}
inline void BulkStoreSharedToGlobal(void* global, const void* smem, uint32_t bytes) {
  host::BulkStore(global, smem, bytes);
}
inline void BulkCommitGroup() { host::BulkCommit(); }
template <int kPending>
inline void BulkWaitGroupRead() {
  host::BulkWait(kPending, true);
}
template <int kPending>
inline void BulkWaitGroup() {
  host::BulkWait(kPending, false);
}
inline void FenceProxyAsyncShared() { host::FenceProxyAsync(host::ProxyFenceSpace::kShared); }
inline void FenceProxyAsyncGlobal() { host::FenceProxyAsync(host::ProxyFenceSpace::kGlobal); }

#else  // nvcc

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* flag) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(uint64_t* flag, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" : : "l"(flag), "l"(v) : "memory");
}

__device__ __forceinline__ void MbarrierInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" : : "r"(SharedAddress(bar)), "r"(count));
}

// Makes the initialised barriers visible to the other threads (and the bulk-copy engine).
__device__ __forceinline__ void FenceMbarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void MbarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" : : "r"(SharedAddress(bar)) : "memory");
}

__device__ __forceinline__ void MbarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :
               : "r"(SharedAddress(bar)), "r"(bytes)
               : "memory");
}

// True once the barrier's phase of parity `parity` has completed (false: not yet, try again).
__device__ __forceinline__ bool MbarrierTryWaitParity(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(SharedAddress(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// global -> shared, completing `bytes` on the barrier (16-byte aligned, a multiple of 16).
__device__ __forceinline__ void BulkLoadGlobalToShared(void* smem, const void* global,
                                                       uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      :
      : "r"(SharedAddress(smem)), "l"(global), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}

// shared -> global (16-byte aligned, a multiple of 16), in the thread's current bulk group.
__device__ __forceinline__ void BulkStoreSharedToGlobal(void* global, const void* smem,
                                                        uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               :
               : "l"(global), "r"(SharedAddress(smem)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void BulkCommitGroup() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void BulkWaitGroupRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;" : : "n"(kPending) : "memory");
}

template <int kPending>
__device__ __forceinline__ void BulkWaitGroup() {
  asm volatile("cp.async.bulk.wait_group %0;" : : "n"(kPending) : "memory");
}

__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void FenceProxyAsyncGlobal() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

#endif

}  // namespace ptx
}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_DEVICE_PTX_CUH_
