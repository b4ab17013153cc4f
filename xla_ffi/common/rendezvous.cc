#include "xla_ffi/common/rendezvous.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace jax_hybridep {
namespace {

// The calling thread's floating-point control state (x86: MXCSR; AArch64: FPCR), whose
// flush-to-zero bits XLA's CPU runtime sets while it runs a program. Workers run a task's steps
// under its caller's state, so a step computes the same bits whichever thread runs it.
struct FloatMode {
#if defined(__x86_64__) || defined(__i386__)
  unsigned int csr = _mm_getcsr();
  void Apply() const { _mm_setcsr(csr); }
#elif defined(__aarch64__) && defined(__GNUC__)
  uint64_t fpcr = Read();
  static uint64_t Read() {
    uint64_t value;
    asm volatile("mrs %0, fpcr" : "=r"(value));
    return value;
  }
  void Apply() const { asm volatile("msr fpcr, %0" : : "r"(fpcr)); }
#else
  void Apply() const {}
#endif
};

using Clock = std::chrono::steady_clock;

struct Key {
  int64_t run_id, site, group, generation;
  bool operator<(const Key& o) const {
    return std::tie(run_id, site, group, generation) <
           std::tie(o.run_id, o.site, o.group, o.generation);
  }
};

struct Exchange {
  std::string name;
  Key key;
  std::chrono::milliseconds timeout;
  Clock::time_point deadline;
  std::vector<std::optional<Participant>> ranks;
  int64_t arrived = 0;
};

struct Registry {
  std::mutex mu;
  std::condition_variable watchdog_wakeup;
  bool watchdog_started = false;
  std::map<Key, std::unique_ptr<Exchange>> open;
  // (site, group, rank) -> (run id, calls so far in that run): the generation of the next call.
  // Call sites are trace-time ids, so a process that retraces makes new ones without end: an
  // entry lives only while its site is busy (see ForgetQuiescentSite, ForgetFailedSite).
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::pair<int64_t, int64_t>> calls;
  // Runs in which an exchange failed, with the first failure: the run's later exchanges fail at
  // once instead of each waiting out its timeout for ranks that have stopped.
  std::deque<std::pair<int64_t, std::string>> failed_runs;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: the watchdog outlives main
  return *registry;
}

std::string FormatRanks(const std::vector<int64_t>& ranks) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  out << "]";
  return out.str();
}

std::string Describe(const Exchange& ex) {
  std::ostringstream out;
  out << "jax_hybridep: exchange '" << ex.name << "' (call site " << ex.key.site << ", EP group "
      << ex.key.group << ", generation " << ex.key.generation << ")";
  return out.str();
}

const std::string* FailedRun(const Registry& registry, int64_t run_id) {
  for (const auto& [id, message] : registry.failed_runs) {
    if (id == run_id) return &message;
  }
  return nullptr;
}

void RecordFailedRun(Registry& registry, int64_t run_id, const std::string& message) {
  if (FailedRun(registry, run_id) != nullptr) return;
  registry.failed_runs.emplace_back(run_id, message);
  if (registry.failed_runs.size() > 64) registry.failed_runs.pop_front();
}

// Completes a rank on a thread of its own: its callback resumes that device's XLA work, which may
// block (e.g. in a collective) and must not hold up the thread that completed it.
//
// Threads are cached: one that finished its callback waits a while for the next instead of
// exiting, so steady-state exchanges start no threads. A callback may block for as long as it
// likes: when no cached thread is idle, a new one starts, so nothing ever waits for a thread.
class CompletionThreads {
 public:
  static CompletionThreads& Get() {
    static CompletionThreads* threads = new CompletionThreads();  // never destroyed
    return *threads;
  }

  void Run(std::function<void()> fn) {
    std::unique_lock<std::mutex> lock(mu_);
    if (idle_ > static_cast<int64_t>(tasks_.size())) {
      tasks_.push_back(std::move(fn));
      wakeup_.notify_one();
      return;
    }
    lock.unlock();
    std::thread([this, fn = std::move(fn)]() mutable { Loop(std::move(fn)); }).detach();
  }

 private:
  void Loop(std::function<void()> fn) {
    while (true) {
      fn();
      fn = nullptr;
      std::unique_lock<std::mutex> lock(mu_);
      ++idle_;
      const bool got =
          wakeup_.wait_for(lock, std::chrono::seconds(10), [&] { return !tasks_.empty(); });
      --idle_;
      if (!got) return;  // idle for long: let the thread go
      fn = std::move(tasks_.front());
      tasks_.pop_front();
    }
  }

  std::mutex mu_;
  std::condition_variable wakeup_;
  std::deque<std::function<void()>> tasks_;
  int64_t idle_ = 0;  // threads waiting in Loop (guarded by mu_)
};

void CompleteDetached(Participant participant, Status status) {
  auto shared =
      std::make_shared<std::pair<Participant, Status>>(std::move(participant), std::move(status));
  CompletionThreads::Get().Run([shared] { shared->first.done(shared->second); });
}

// Fails every rank of `ex` that has arrived. Called without the registry lock held.
void FailArrived(Exchange& ex, const Status& status) {
  for (auto& participant : ex.ranks) {
    if (participant.has_value()) CompleteDetached(std::move(*participant), status);
  }
}

// The generation of this rank's next call at (site, group) in run `run_id`.
int64_t NextGeneration(Registry& registry, int64_t run_id, int64_t site, int64_t group,
                       int64_t rank) {
  auto& [last_run, calls] = registry.calls[{site, group, rank}];
  if (last_run != run_id) {
    last_run = run_id;
    calls = 0;
  }
  return calls++;
}

// The counters of every rank at (site, group): a contiguous range of `calls`.
auto SiteCounters(Registry& registry, int64_t site, int64_t group) {
  constexpr int64_t kLowest = std::numeric_limits<int64_t>::min();
  constexpr int64_t kHighest = std::numeric_limits<int64_t>::max();
  return std::make_pair(registry.calls.lower_bound({site, group, kLowest}),
                        registry.calls.upper_bound({site, group, kHighest}));
}

// Called when exchange `key` of `num_ranks` ranks has every rank: if no rank has called the site
// since (every rank's count is key.generation + 1), no exchange of the site is open and its
// counters go. A later call at the site, in this run or another, starts again at generation 0 on
// every rank alike, so keys stay unique among the open exchanges and ranks agree on them.
void ForgetQuiescentSite(Registry& registry, const Key& key, int64_t num_ranks) {
  const std::pair<int64_t, int64_t> settled{key.run_id, key.generation + 1};
  auto [first, last] = SiteCounters(registry, key.site, key.group);
  int64_t count = 0;
  for (auto it = first; it != last; ++it, ++count) {
    if (it->second != settled) return;
  }
  if (count == num_ranks) registry.calls.erase(first, last);
}

// Called when exchange `key` failed: the rest of its run is skipped without counting calls, so
// the site's counters for that run are of no further use.
void ForgetFailedSite(Registry& registry, const Key& key) {
  auto [it, last] = SiteCounters(registry, key.site, key.group);
  while (it != last) {
    it = it->second.first == key.run_id ? registry.calls.erase(it) : std::next(it);
  }
}

void Watchdog() {
  Registry& registry = GetRegistry();
  std::unique_lock<std::mutex> lock(registry.mu);
  while (true) {
    auto earliest = registry.open.end();
    for (auto it = registry.open.begin(); it != registry.open.end(); ++it) {
      if (earliest == registry.open.end() || it->second->deadline < earliest->second->deadline) {
        earliest = it;
      }
    }
    if (earliest == registry.open.end()) {
      registry.watchdog_wakeup.wait(lock);
      continue;
    }
    // A copy: wait_until reads its deadline again after waking, when the exchange may be gone
    // (completed and freed by its last rank while the lock was released).
    const Clock::time_point deadline = earliest->second->deadline;
    if (Clock::now() < deadline) {
      registry.watchdog_wakeup.wait_until(lock, deadline);
      continue;
    }
    std::unique_ptr<Exchange> ex = std::move(earliest->second);
    registry.open.erase(earliest);
    std::vector<int64_t> missing, arrived;
    for (int64_t r = 0; r < static_cast<int64_t>(ex->ranks.size()); ++r) {
      (ex->ranks[r].has_value() ? arrived : missing).push_back(r);
    }
    std::ostringstream msg;
    msg << Describe(*ex) << " timed out after " << ex->timeout.count() / 1000.0 << " s: EP ranks "
        << FormatRanks(missing) << " of " << ex->ranks.size()
        << " did not arrive (arrived: " << FormatRanks(arrived)
        << "). A rank stopped or ranks ran different programs; if they are merely slow, raise "
           "DispatchConfig(timeout_s=...) or JAX_HYBRIDEP_TIMEOUT_S.";
    const Status status{Status::Code::kDeadlineExceeded, msg.str()};
    RecordFailedRun(registry, ex->key.run_id, status.message);
    ForgetFailedSite(registry, ex->key);
    lock.unlock();
    FailArrived(*ex, status);
    lock.lock();
  }
}

// A process-wide pool of worker threads for the ranks' write and read steps. A step
// only copies and adds into buffers its exchange owns and never waits for anything, so the pool
// cannot deadlock; the calling thread takes indices too, so a call finishes even when every
// worker is busy with another exchange's steps.
class WorkerPool {
 public:
  static WorkerPool& Get() {
    static WorkerPool* pool = new WorkerPool();  // never destroyed: workers outlive main
    return *pool;
  }

  void Run(int64_t n, const std::function<void(int64_t)>& fn) {
    if (n <= 0) return;
    auto task = std::make_shared<Task>();
    task->fn = &fn;
    task->mode = FloatMode();
    task->n = n;
    if (n > 1 && num_workers_ > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(task);
    }
    if (n > 1) wakeup_.notify_all();
    Work(*task);
    std::unique_lock<std::mutex> lock(task->mu);
    task->finished.wait(lock, [&] { return task->done == task->n; });
  }

 private:
  struct Task {
    const std::function<void(int64_t)>* fn;
    int64_t n = 0;
    FloatMode mode;  // the caller's
    std::atomic<int64_t> next{0};
    std::mutex mu;
    int64_t done = 0;  // guarded by mu
    std::condition_variable finished;
  };

  WorkerPool() {
    // One worker per further core (at least one, at most 63): a step is memory-bound, so more
    // threads than cores only add switching.
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    num_workers_ = std::clamp(cores - 1, 1, 63);
    for (int i = 0; i < num_workers_; ++i) std::thread([this] { WorkerLoop(); }).detach();
  }

  // Runs indices of `task` until none is left unclaimed.
  static void Work(Task& task) {
    while (true) {
      const int64_t i = task.next.fetch_add(1);
      if (i >= task.n) return;
      (*task.fn)(i);
      std::lock_guard<std::mutex> lock(task.mu);
      if (++task.done == task.n) task.finished.notify_all();
    }
  }

  void WorkerLoop() {
    while (true) {
      std::shared_ptr<Task> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wakeup_.wait(lock, [&] {
          while (!queue_.empty() && queue_.front()->next.load() >= queue_.front()->n) {
            queue_.pop_front();  // every index claimed
          }
          return !queue_.empty();
        });
        task = queue_.front();
      }
      const FloatMode own;
      task->mode.Apply();
      Work(*task);
      own.Apply();
    }
  }

  int num_workers_ = 0;
  std::mutex mu_;
  std::condition_variable wakeup_;
  std::deque<std::shared_ptr<Task>> queue_;
};

// Runs fn(0..n-1) on the worker pool and the calling thread: every rank's step touches its own
// slice of the peers' buffers, so they run in parallel like the devices would.
void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  WorkerPool::Get().Run(n, fn);
}

}  // namespace

void JoinExchange(const std::string& name, int64_t run_id, int64_t site, int64_t group,
                  int64_t rank, int64_t num_ranks, std::chrono::milliseconds timeout,
                  Participant participant) {
  // Whichever thread completes this rank resumes its device's program: under the floating-point
  // mode the rank arrived with (a completion thread's own mode is its creator's).
  participant.done = [done = std::move(participant.done), mode = FloatMode()](const Status& s) {
    mode.Apply();
    done(s);
  };
  Registry& registry = GetRegistry();
  std::unique_lock<std::mutex> lock(registry.mu);
  // A failed run's calls are skipped before they are counted: they leave no state behind.
  if (const std::string* failure = FailedRun(registry, run_id)) {
    Status status{Status::Code::kAborted, "jax_hybridep: exchange '" + name +
                                              "' skipped: an earlier exchange of this "
                                              "execution failed: " +
                                              *failure};
    lock.unlock();
    participant.done(status);
    return;
  }
  const Key key{run_id, site, group, NextGeneration(registry, run_id, site, group, rank)};
  auto [it, inserted] = registry.open.try_emplace(key, nullptr);
  if (inserted) {
    it->second =
        std::make_unique<Exchange>(Exchange{name, key, timeout, Clock::now() + timeout,
                                            std::vector<std::optional<Participant>>(num_ranks), 0});
    if (!registry.watchdog_started) {
      registry.watchdog_started = true;
      std::thread(Watchdog).detach();
    }
    registry.watchdog_wakeup.notify_one();
  }
  Exchange& ex = *it->second;
  if (rank < 0 || rank >= num_ranks || ex.ranks[rank].has_value() ||
      static_cast<int64_t>(ex.ranks.size()) != num_ranks) {
    std::ostringstream msg;
    msg << Describe(ex) << ": EP rank " << rank << " of " << num_ranks
        << " is out of range, arrived twice, or disagrees on the EP size (" << ex.ranks.size()
        << "); every device of one EP group needs a distinct rank (are all "
        << "non-EP mesh axes manual in the shard_map?)";
    const Status status{Status::Code::kFailedPrecondition, msg.str()};
    std::unique_ptr<Exchange> failed = std::move(it->second);
    registry.open.erase(it);
    RecordFailedRun(registry, run_id, status.message);
    ForgetFailedSite(registry, key);
    lock.unlock();
    FailArrived(*failed, status);
    participant.done(status);
    return;
  }
  ex.ranks[rank] = std::move(participant);
  if (++ex.arrived < num_ranks) return;

  // Last to arrive: run the exchange for everyone, outside the lock.
  std::unique_ptr<Exchange> mine = std::move(it->second);
  registry.open.erase(it);
  ForgetQuiescentSite(registry, key, num_ranks);
  lock.unlock();
  std::vector<Published> published(num_ranks);
  for (int64_t r = 0; r < num_ranks; ++r) published[r] = mine->ranks[r]->published;
  ParallelFor(num_ranks, [&](int64_t r) { mine->ranks[r]->write(published); });
  std::vector<Status> statuses(num_ranks);
  ParallelFor(num_ranks, [&](int64_t r) { statuses[r] = mine->ranks[r]->read(); });
  for (int64_t r = 0; r < num_ranks; ++r) {
    if (!statuses[r].ok()) {
      std::lock_guard<std::mutex> relock(registry.mu);
      RecordFailedRun(registry, run_id, statuses[r].message);
      break;
    }
  }
  for (int64_t r = 0; r < num_ranks; ++r) {
    if (r != rank) CompleteDetached(std::move(*mine->ranks[r]), statuses[r]);
  }
  mine->ranks[rank]->done(statuses[rank]);
}

// Read by the test module only (declared in lab/native/introspection.h): exchanges waiting for
// ranks, and generation counters held.
int64_t OpenExchangeCount() {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  return static_cast<int64_t>(registry.open.size());
}

int64_t CallSiteStateCount() {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  return static_cast<int64_t>(registry.calls.size());
}

}  // namespace jax_hybridep
