// The host executor's probe kernels (probes.cu, probes_memory.cu), run by name on the configured
// executor.
#ifndef JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PROBES_H_
#define JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PROBES_H_

#include <cstdint>
#include <string>
#include <vector>

namespace jax_hybridep::host {

// Runs probe `name` (with its one argument) and returns its outputs; a report is thrown.
std::vector<int64_t> RunProbe(const std::string& name, int64_t arg);
// The probes of global memory's checks (probes_memory.cu): false when none is named `name`.
bool RunMemoryProbe(const std::string& name, int64_t arg, std::vector<int64_t>* out);

}  // namespace jax_hybridep::host

#endif  // JAX_HYBRIDEP_LAB_HOST_EXECUTOR_PROBES_H_
