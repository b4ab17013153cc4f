// The PTX instructions the kernels use (xla_ffi/cuda/device/ptx.cuh), as the host executor performs
// them (docs/host_executor.md): mbarriers with phases and transaction counts, the bulk-copy
// engine, system-scope acquire/release flags, proxy fences, %globaltimer, and shared memory from
// the block's bounds-checked arena.
#ifndef JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PTX_H_
#define JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PTX_H_

#include <cstddef>
#include <cstdint>

namespace jax_hybridep::host {

uint64_t GlobalTimer();
uint64_t LoadAcquire(const uint64_t* flag);
void StoreRelease(uint64_t* flag, uint64_t value);

void MbarrierInit(uint64_t* bar, uint32_t count);
void FenceMbarrierInit();
void MbarrierArrive(uint64_t* bar, uint32_t expect_bytes);
bool MbarrierTryWaitParity(uint64_t* bar, uint32_t parity);

void BulkLoad(void* shared, const void* global, uint32_t bytes, uint64_t* bar);
void BulkStore(void* global, const void* shared, uint32_t bytes);
void BulkCommit();
// Waits until at most `pending` of this thread's committed groups are incomplete: their reads of
// shared memory (read_only) or all their writes too.
void BulkWait(int pending, bool read_only);
enum class ProxyFenceSpace { kShared, kGlobal };
void FenceProxyAsync(ProxyFenceSpace space);

// A __shared__ declaration of the block (the n-th the thread reaches), and the dynamic shared
// memory of the launch.
void* StaticShared(const char* name, size_t bytes, size_t align);
void* DynamicShared(size_t align);

}  // namespace jax_hybridep::host

#endif  // JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PTX_H_
