// What the host executor checks about global memory besides races (docs/host_executor.md):
// which bytes of cudaMalloc'd memory something wrote, as compute-sanitizer's initcheck does (a
// device read of a byte nothing wrote since its cudaMalloc is a report), and which GPUs may
// reach which peers' memory (a kernel or its bulk copy touching the memory of a GPU its own GPU
// never enabled with cudaDeviceEnablePeerAccess is a report: a GPU faults there). Kept apart from
// the race detector's shadow (memory.h), hooked into Executor::Access, the stream's memory
// operations and the runtime API (init_tracking.cc).
#ifndef JAX_HYBRIDEP_LAB_HOST_EXECUTOR_INIT_TRACKING_H_
#define JAX_HYBRIDEP_LAB_HOST_EXECUTOR_INIT_TRACKING_H_

#include <cstddef>

namespace jax_hybridep::host {

class Executor;
struct Knowledge;
struct Region;

// cudaMalloc: the `bytes` at `begin`, every one uninitialised.
void TrackInitialisation(const void* begin, size_t bytes);
// cudaFree.
void ForgetInitialisation(const void* begin);
// cudaDeviceEnablePeerAccess on `gpu` for `peer`: false when it was enabled already.
bool EnablePeerAccess(int gpu, int peer);
// A new run (Executor::Reset): nothing tracked, no peer access enabled.
void ResetTracking();

// An access Executor::Access has found in bounds of region `r`: writes initialise; a kernel
// thread's or a bulk copy's read of bytes nothing wrote, or its access to another GPU's memory
// without peer access, is a report (Executor::Fail). Reads of the stream's own memcpys are not
// checked: a copy carries the initialisation along instead (CopyInitialisation).
void CheckTracked(Executor& e, const Knowledge& k, const Region* r, const char* p, size_t bytes,
                  bool write, const void* pc);
// After a memcpy has written dst: its bytes are initialised where src's were (a source nothing
// tracks, host memory, counts as written).
void CopyInitialisation(char* dst, const char* src, size_t bytes);

}  // namespace jax_hybridep::host

#endif  // JAX_HYBRIDEP_LAB_HOST_EXECUTOR_INIT_TRACKING_H_
