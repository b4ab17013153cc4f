// Process-wide meeting point for the ranks of one exchange (the host handlers' direct-write
// transport; the CUDA windows take its Status).
//
// XLA:CPU runs each device's program on its own thread, and its thunk executor may order
// independent thunks differently on different devices. A custom call that blocked its device
// thread until its peers arrived could therefore deadlock against an XLA collective that a peer
// entered first. So nothing here blocks: each rank arrives with its buffers and the steps it
// contributes (write into peers, then read its own), and returns at once; the last rank to arrive
// runs every rank's write steps (in parallel, on a process-wide pool of one worker per core beside
// the calling thread), then every rank's read steps, then completes each rank's callback (the
// handlers complete their asynchronous FFI results from it) on cached threads of their own.
//
// A rendezvous is keyed by (execution, call site, EP group, generation) (docs/design.md §2.1.7):
// the run id is shared by all devices of one execution; the call site is a trace-time id; the group
// comes from the non-EP mesh axes; the generation counts repeated executions of one call site
// within an execution (scan, remat). A call site's generation counters are dropped once its
// exchanges have completed (sites are trace-time ids, so a process that retraces makes new ones
// without end), and a later call starts again at generation 0. A watchdog fails a rendezvous that
// is not complete by its deadline with an error naming the ranks that did not arrive, and fails the
// rest of that execution's exchanges at once; no state is left behind, so the process stays usable.
#ifndef JAX_HYBRIDEP_XLA_FFI_COMMON_RENDEZVOUS_H_
#define JAX_HYBRIDEP_XLA_FFI_COMMON_RENDEZVOUS_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace jax_hybridep {

// Success, or a failure with its message.
struct Status {
  enum class Code { kOk, kDeadlineExceeded, kAborted, kFailedPrecondition };
  Code code = Code::kOk;
  std::string message;

  bool ok() const { return code == Code::kOk; }
  static Status Ok() { return {}; }
};

inline constexpr int kMaxPublished = 4;
// Pointers a rank makes visible to its peers (its receive buffers, or data to read).
using Published = std::array<void*, kMaxPublished>;

// What one rank brings to an exchange.
struct Participant {
  Published published{};
  // Step 1, once every rank has arrived: write into the peers' published buffers.
  std::function<void(const std::vector<Published>& peers)> write;
  // Step 2, once every rank has written: read this rank's own buffers.
  std::function<Status()> read;
  // Called exactly once with the outcome; after it, no step of this rank runs again.
  std::function<void(const Status&)> done;
};

// Adds `participant` as `rank` of this call's exchange (`name` labels errors). When this rank is
// the last to arrive, every rank's steps run from the calling thread and this rank's `done` is
// called before returning; the other ranks' `done` run on threads of their own, so a callback
// that resumes XLA work cannot hold up the caller.
void JoinExchange(const std::string& name, int64_t run_id, int64_t site, int64_t group,
                  int64_t rank, int64_t num_ranks, std::chrono::milliseconds timeout,
                  Participant participant);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_COMMON_RENDEZVOUS_H_
