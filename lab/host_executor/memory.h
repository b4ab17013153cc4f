// The host executor's memory (docs/host_executor.md): every allocation a kernel may touch (a
// virtual GPU's global memory, mapped memory, a block's shared memory) is a region with a
// red zone on each side and a shadow per byte: the last write and read (agent, event, source
// address), whether they were relaxed atomics, and the bulk copy in flight into it. Anything
// else a kernel touches (its stack, its parameters) is not tracked.
#ifndef JAX_HYBRIDEP_LAB_HOST_EXECUTOR_MEMORY_H_
#define JAX_HYBRIDEP_LAB_HOST_EXECUTOR_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace jax_hybridep::host {

enum class RegionKind { kGlobal, kMapped, kShared, kRedZone };

// Byte flags.
constexpr uint8_t kWriteRelaxed = 1;  // the last write was an atomic (or volatile) one
constexpr uint8_t kReadRelaxed = 2;   // the last read was
constexpr uint8_t kMoreReaders = 4;   // reads not ordered after each other: Memory::readers

struct ByteShadow {
  uint32_t w_id = 0, w_event = 0;
  uint32_t r_id = 0, r_event = 0;
  uint32_t pending = 0;  // the bulk copy whose write into this byte is in flight (its agent id)
  uint8_t flags = 0;
  const void* w_pc = nullptr;
  const void* r_pc = nullptr;
};

struct Reader {
  uint32_t id, event;
  const void* pc;
  bool relaxed;
};

struct Region {
  char* begin = nullptr;
  char* end = nullptr;
  RegionKind kind = RegionKind::kGlobal;
  int gpu = 0;
  const void* block = nullptr;  // shared memory: its block
  std::string name;
  const Region* guarded = nullptr;  // a red zone: the allocation it borders
  std::vector<ByteShadow> shadow;   // one per byte (not for red zones)
  bool touched = false;             // accessed since the last ResetEpochs
};

class Memory {
 public:
  static constexpr size_t kRedZone = 64;
  static constexpr uint8_t kPoison = 0xff;  // NaN in every float format, -1 in every integer

  // A tracked allocation of `bytes` (`align` a power of two), poisoned, red zones around it.
  Region* Allocate(size_t bytes, size_t align, RegionKind kind, int gpu, const void* block,
                   std::string name);
  // Frees an allocation made above (by its start).
  bool Free(const void* begin);
  // The region holding `p`, red zones included; null when untracked.
  Region* Find(const void* p) const;
  // Forgets every access (after a point where all virtual GPUs were idle).
  void ResetEpochs();
  void Clear();

  std::unordered_map<const char*, std::vector<Reader>> readers;  // bytes with kMoreReaders

 private:
  struct Allocation {
    void* raw;
    std::unique_ptr<Region> regions[3];  // red zone, data, red zone
  };
  std::map<uintptr_t, Region*> regions_;  // by begin: the allocations' non-empty regions
  std::unordered_map<const void*, Allocation> allocations_;
};

}  // namespace jax_hybridep::host

#endif  // JAX_HYBRIDEP_LAB_HOST_EXECUTOR_MEMORY_H_
