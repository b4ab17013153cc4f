// Vector clocks of the host executor's race detector (docs/host_executor.md "Races").
//
// Every agent that touches memory (a CUDA thread, one bulk copy, a stream's memset or memcpy) has
// an id; a clock maps ids to the last event of that agent known to happen before. Clocks are
// sparse (sorted (id, event) pairs), immutable once built and shared: after a __syncthreads the
// 256 threads of a block hold one clock. Ids are issued afresh after every point where all
// virtual GPUs are idle (everything before it happens before everything after).
#ifndef JAX_HYBRIDEP_LAB_HOST_EXECUTOR_CLOCK_H_
#define JAX_HYBRIDEP_LAB_HOST_EXECUTOR_CLOCK_H_

#include <cstdint>
#include <memory>
#include <vector>

namespace jax_hybridep::host {

struct ClockEntry {
  uint32_t id;
  uint32_t event;
};
using Clock = std::vector<ClockEntry>;  // sorted by id, events > 0
using ClockRef = std::shared_ptr<const Clock>;

// The event of `id` known by `clock` (0: none).
uint32_t Lookup(const ClockRef& clock, uint32_t id);

// The pointwise maximum of a and b (either may be null: empty).
ClockRef Join(const ClockRef& a, const ClockRef& b);

// `clock` with id's entry raised to at least `event`.
ClockRef With(const ClockRef& clock, uint32_t id, uint32_t event);

// The pointwise maximum of many clocks at once, and of `extra` entries besides (a barrier's
// join: the waiters' shared knowledge, and each waiter's own event).
ClockRef JoinAll(const std::vector<ClockRef>& clocks, std::vector<ClockEntry> extra = {});

}  // namespace jax_hybridep::host

#endif  // JAX_HYBRIDEP_LAB_HOST_EXECUTOR_CLOCK_H_
