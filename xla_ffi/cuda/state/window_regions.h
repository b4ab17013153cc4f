// One rank's window of the GPU transport (kernels/transport.h): the registered device memory
// every peer writes into, its regions and their offsets (the same on every rank of a group), and
// the mapped record its failed waits write to (pinned memory every GPU reaches). Plain C++: the
// handlers allocate it
// (window_registry.cc), the kernels address it.
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_STATE_WINDOW_REGIONS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_STATE_WINDOW_REGIONS_H_

#include <cstddef>
#include <cstdint>

#include "xla_ffi/common/limits.h"   // kMaxWindowRanks, kMaxSendBlocks
#include "xla_ffi/common/numeric.h"  // JAX_HYBRIDEP_CPU_AND_GPU

namespace jax_hybridep {

// What a window is sized for.
struct WindowGeometry {
  int64_t ranks;      // S, the level's GPUs
  int64_t items;      // M, items per rank
  int64_t row_bytes;  // the widest row this window carries
};

// Byte offsets of a window's regions from its base.
struct WindowRegions {
  int64_t slot_stride;  // bytes of one payload slot (row bytes rounded up to 16)
  int64_t slots;        // slots per half: ranks * items (dense dispatch slots or combine partials)
  int64_t payload[2];   // [slots, slot_stride] each: the halves exchanges alternate between
  int64_t arrived;      // uint64 [ranks, kMaxSendBlocks]: the tag each source block last raised
  int64_t epoch;        // uint64: exchanges this rank finished on the window
  int64_t done;         // uint32: blocks of the running exchange's final kernel that finished
  int64_t error_claim;  // uint32: set by the first failed wait of this rank
  int64_t total;
};

WindowRegions WindowRegionsFor(const WindowGeometry& geometry);
size_t WindowBytes(const WindowGeometry& geometry);

// Where this rank's first failed wait is recorded: in mapped memory, written once.
struct TransportError {
  uint32_t code;   // 0: none, else kWaitTimeout or kWaitMismatch
  uint32_t rank;   // the rank that waited
  uint32_t peer;   // the source rank it waited for
  uint32_t block;  // the sender block whose flag never came (or was another exchange's)
  uint64_t generation;
  uint64_t seen;      // the flag the failed wait read last
  uint64_t expected;  // the tag it waited for
};
constexpr uint32_t kWaitTimeout = 1;
constexpr uint32_t kWaitMismatch = 2;

// Every rank's window base as this device addresses it (a __grid_constant__ kernel parameter).
struct PeerWindows {
  char* base[kMaxWindowRanks];
};

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_STATE_WINDOW_REGIONS_H_
