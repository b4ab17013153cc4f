#include "xla_ffi/rendezvous.h"

#include <deque>
#include <map>
#include <sstream>
#include <tuple>

namespace jax_hybridep {
namespace {

std::string FormatRanks(const std::vector<int64_t>& ranks) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  out << "]";
  return out.str();
}

struct Registry {
  std::mutex mu;
  std::map<RendezvousKey, std::shared_ptr<Rendezvous>> open;
  std::map<RendezvousKey, int64_t> left;
  // (site, group, rank) -> (run id, calls so far in that run): the generation of the next call.
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::pair<int64_t, int64_t>> calls;
  // Runs in which a rendezvous failed: later rendezvous of the run fail at once instead of each
  // waiting out its own timeout for ranks that have already stopped.
  std::deque<std::pair<int64_t, std::string>> failed_runs;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: handlers may run at exit
  return *registry;
}

const std::string* FailedRun(Registry& registry, int64_t run_id) {
  for (const auto& [id, message] : registry.failed_runs) {
    if (id == run_id) return &message;
  }
  return nullptr;
}

}  // namespace

bool RendezvousKey::operator<(const RendezvousKey& other) const {
  return std::tie(run_id, site, group, generation) <
         std::tie(other.run_id, other.site, other.group, other.generation);
}

Rendezvous::Rendezvous(std::string name, RendezvousKey key, int64_t num_ranks)
    : name_(std::move(name)), key_(key), num_ranks_(num_ranks), published_(num_ranks) {
  for (auto& present : present_) present.assign(num_ranks, false);
}

Status Rendezvous::Arrive(int64_t rank, const Published& published,
                          std::chrono::milliseconds timeout) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (rank < 0 || rank >= num_ranks_ || present_[0][rank]) {
      std::ostringstream msg;
      msg << "jax_hybridep: rendezvous '" << name_ << "' (call site " << key_.site << ", EP group "
          << key_.group << "): EP rank " << rank
          << (rank < 0 || rank >= num_ranks_ ? " is out of range" : " arrived twice")
          << " for an EP size of " << num_ranks_
          << "; every device of one EP group must have a distinct rank (are all non-EP mesh "
             "axes manual in the shard_map?)";
      failed_ = true;
      failure_ = msg.str();
      cv_.notify_all();
      return Status{false, false, failure_};
    }
    published_[rank] = published;
  }
  return Wait(0, rank, timeout);
}

void Rendezvous::Fail(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_) {
    failed_ = true;
    failure_ = message;
  }
  cv_.notify_all();
}

std::string Rendezvous::failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_ ? failure_ : std::string();
}

Status Rendezvous::Depart(int64_t rank, std::chrono::milliseconds timeout) {
  return Wait(1, rank, timeout);
}

Status Rendezvous::Wait(int phase, int64_t rank, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  present_[phase][rank] = true;
  ++count_[phase];
  cv_.notify_all();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const bool complete =
      cv_.wait_until(lock, deadline, [&] { return failed_ || count_[phase] == num_ranks_; });
  if (failed_) return Status{false, false, failure_};
  if (complete) return Status::Ok();
  std::vector<int64_t> missing, arrived;
  for (int64_t r = 0; r < num_ranks_; ++r) (present_[phase][r] ? arrived : missing).push_back(r);
  std::ostringstream msg;
  msg << "jax_hybridep: rendezvous '" << name_ << "' (call site " << key_.site << ", EP group "
      << key_.group << ", generation " << key_.generation << ") timed out after "
      << timeout.count() / 1000.0 << " s " << (phase == 0 ? "before the exchange" : "during it")
      << ": EP ranks " << FormatRanks(missing) << " of " << num_ranks_
      << " did not arrive (arrived: " << FormatRanks(arrived)
      << "). A rank stopped, or ranks ran different programs; raise the timeout with "
         "DispatchConfig(timeout_s=...) or JAX_HYBRIDEP_TIMEOUT_S if they are merely slow.";
  failed_ = true;
  failure_ = msg.str();
  cv_.notify_all();
  return Status{false, true, failure_};
}

std::shared_ptr<Rendezvous> JoinRendezvous(const std::string& name, int64_t run_id, int64_t site,
                                           int64_t group, int64_t rank, int64_t num_ranks) {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  auto& [last_run, calls] = registry.calls[{site, group, rank}];
  if (last_run != run_id) {
    last_run = run_id;
    calls = 0;
  }
  const RendezvousKey key{run_id, site, group, calls++};
  auto [it, inserted] = registry.open.try_emplace(key, nullptr);
  if (inserted) {
    it->second = std::make_shared<Rendezvous>(name, key, num_ranks);
    registry.left[key] = 0;
    if (const std::string* failure = FailedRun(registry, run_id)) {
      it->second->Fail("jax_hybridep: rendezvous '" + name +
                       "' skipped: an earlier exchange of this execution failed: " + *failure);
    }
  }
  return it->second;
}

void LeaveRendezvous(const std::shared_ptr<Rendezvous>& rendezvous, int64_t num_ranks) {
  Registry& registry = GetRegistry();
  const std::string failure = rendezvous->failure();
  std::lock_guard<std::mutex> lock(registry.mu);
  const RendezvousKey& key = rendezvous->key();
  if (!failure.empty() && FailedRun(registry, key.run_id) == nullptr) {
    registry.failed_runs.emplace_back(key.run_id, failure);
    if (registry.failed_runs.size() > 64) registry.failed_runs.pop_front();
  }
  auto it = registry.open.find(key);
  if (it == registry.open.end() || it->second != rendezvous) return;
  if (!failure.empty() || ++registry.left[key] == num_ranks) {
    registry.open.erase(it);
    registry.left.erase(key);
  }
}

int64_t OpenRendezvousCount() {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  return static_cast<int64_t>(registry.open.size());
}

}  // namespace jax_hybridep
