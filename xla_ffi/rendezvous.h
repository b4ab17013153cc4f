// Process-wide rendezvous for the ranks of one exchange (host direct-write transport).
//
// XLA:CPU runs each device's instance of a custom call on its own thread, concurrently, so the
// ranks of an EP group that live in one process meet here: each publishes pointers to its buffers,
// waits for the others, writes into theirs, and waits again before reading its own.
//
// A rendezvous is keyed by (execution, call site, EP group, generation) (DESIGN §2.1.7): the run
// id is shared by all devices of one execution; the call site is a trace-time id; the group comes
// from the non-EP mesh axes; the generation counts repeated executions of one call site within an
// execution (scan, remat). Waits time out with an error naming the ranks that did not arrive, and
// leave no state behind, so the process stays usable.
#ifndef JAX_HYBRIDEP_XLA_FFI_RENDEZVOUS_H_
#define JAX_HYBRIDEP_XLA_FFI_RENDEZVOUS_H_

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace jax_hybridep {

struct RendezvousKey {
  int64_t run_id;
  int64_t site;
  int64_t group;
  int64_t generation;
  bool operator<(const RendezvousKey& other) const;
};

// Success or a message (DEADLINE_EXCEEDED-style failures and protocol misuse).
struct Status {
  bool ok = true;
  bool deadline_exceeded = false;
  std::string message;
  static Status Ok() { return {}; }
};

inline constexpr int kMaxPublished = 4;
using Published = std::array<void*, kMaxPublished>;

class Rendezvous {
 public:
  Rendezvous(std::string name, RendezvousKey key, int64_t num_ranks);

  // Publishes `rank`'s pointers and waits until every rank has published (or the deadline).
  Status Arrive(int64_t rank, const Published& published, std::chrono::milliseconds timeout);
  // Waits until every rank has finished writing into its peers' buffers (or the deadline).
  Status Depart(int64_t rank, std::chrono::milliseconds timeout);

  // Valid after a successful Arrive.
  void* Peer(int64_t rank, int64_t index) const { return published_[rank][index]; }

  // Makes every current and future wait fail with `message`.
  void Fail(const std::string& message);
  // The failure message, or empty.
  std::string failure();
  const RendezvousKey& key() const { return key_; }

 private:
  Status Wait(int phase, int64_t rank, std::chrono::milliseconds timeout);

  const std::string name_;
  const RendezvousKey key_;
  const int64_t num_ranks_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Published> published_;
  std::array<std::vector<bool>, 2> present_;
  std::array<int64_t, 2> count_{0, 0};
  bool failed_ = false;
  std::string failure_;
};

// Joins (creating if needed) the rendezvous for this call. `name` labels errors. Each rank
// must call LeaveRendezvous once it has read its buffers (after Depart) or after a failure.
std::shared_ptr<Rendezvous> JoinRendezvous(const std::string& name, int64_t run_id, int64_t site,
                                           int64_t group, int64_t rank, int64_t num_ranks);
// Forgets the rendezvous once every rank has left, or at once after a failure; a failure also
// fails the rest of that execution's rendezvous at once, instead of each waiting out a timeout
// for ranks that have stopped.
void LeaveRendezvous(const std::shared_ptr<Rendezvous>& rendezvous, int64_t num_ranks);

// Number of rendezvous currently open (for tests: 0 when the process is idle).
int64_t OpenRendezvousCount();

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_RENDEZVOUS_H_
