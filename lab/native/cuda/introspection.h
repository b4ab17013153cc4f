// What the tests and benches read of the CUDA side of the runtime. Declared here, in the
// laboratory, because only the test module calls them; each is defined in the runtime beside
// what it reads (xla_ffi/cuda/state/site_state.cc, xla_ffi/cuda/kernels/send.cu), whose
// production headers stay free of test-only declarations. CUDA builds only.
#ifndef JAX_HYBRIDEP_LAB_NATIVE_CUDA_INTROSPECTION_H_
#define JAX_HYBRIDEP_LAB_NATIVE_CUDA_INTROSPECTION_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_hybridep {

// SiteStates alive in this process, of every kind (the CUDA handlers' per-site state and the
// test module's CPU probe of it): the retrace tests watch it.
int64_t LiveSiteStates();

// The loaded send kernel's registers and shared memory (its static bytes, and the dynamic bytes a
// block may still opt into on the current device), for the benches and the GPU checks; CI reads
// the same from the compiled module's SASS.
cudaError_t GetSendKernelInfo(int* registers, int64_t* static_smem, int64_t* max_dynamic_smem);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_CUDA_INTROSPECTION_H_
