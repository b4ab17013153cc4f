// Limits of the CUDA transport that the Python side validates against (DispatchConfig.num_sms,
// the CUDA bottom's top-k check); the native module exports them (`limits()`) and
// tests/native_test.py checks the Python mirrors. Header-only and framework-free.
#ifndef JAX_HYBRIDEP_XLA_FFI_COMMON_LIMITS_H_
#define JAX_HYBRIDEP_XLA_FFI_COMMON_LIMITS_H_

#include <cstdint>

namespace jax_hybridep {

// Most blocks one rank's send phase may use (the size of a window's flag table per source).
constexpr int64_t kMaxSendBlocks = 256;
// Most routing slots per token the transport kernels take.
constexpr int64_t kMaxTopK = 64;
// Most ranks in one window group (the combine's set of destinations is a bitmask of this size).
constexpr int64_t kMaxWindowRanks = 128;

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_COMMON_LIMITS_H_
