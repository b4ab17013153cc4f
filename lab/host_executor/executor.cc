// The host executor's state and its scheduler (executor.h, scheduler.h): configuration and reset,
// agents and barrier groups, streams, and the loop that picks the next thread or copy stage from
// the seed. Launches and blocks: launches.cc; memory checks and reports: reports.cc.
#include <algorithm>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lab/host_executor/init_tracking.h"
#include "lab/host_executor/scheduler.h"

namespace jax_hybridep::host {

Thread* g_thread = nullptr;

Executor& TheExecutor() {
  static Executor* executor = new Executor();  // never destroyed: fibers may outlive a run
  return *executor;
}

Thread* CurrentThread() { return TheExecutor().current; }

void Configure(const Options& options) {
  Executor& e = TheExecutor();
  e.Reset();
  e.options = options;
  e.Reset();
}

void Reset() { TheExecutor().Reset(); }
const Options& CurrentOptions() { return TheExecutor().options; }
const Stats& CurrentStats() { return TheExecutor().stats; }

Executor::Executor() { Reset(); }

Launch::~Launch() = default;
void FreeDeleter::operator()(char* p) const { std::free(p); }

void Executor::Reset() {
  for (auto& b : blocks) {
    for (auto& t : b->threads) t.reset();  // abandoned fibers: their stacks are unmapped
  }
  blocks.clear();
  ReleaseSpareStacks();
  in_flight.clear();
  runnable.clear();
  sleepers.clear();
  bulk_waiters.clear();
  memory.Clear();
  ResetTracking();
  gpus.clear();
  gpus.resize(std::max(options.gpus, 1));
  for (int g = 0; g < static_cast<int>(gpus.size()); ++g) {
    auto stream = std::make_unique<HostStream>();
    stream->gpu = g;
    gpus[g].streams.push_back(std::move(stream));
    gpus[g].free_slots = std::max(options.sms, 1);
  }
  current_gpu = 0;
  last_error = cudaSuccess;
  max_dynamic_smem.clear();
  agents.assign(1, AgentInfo());
  records.assign(1, LaunchRecord());
  groups.clear();
  sync_vars.clear();
  now_ns = 0;
  current = nullptr;
  g_thread = nullptr;
  failed = false;
  failure = nullptr;
  progress = 0;
  idle_progress = ~0ull;
  idle_stretch_ns = 0;
  stats = Stats();
  rng_state = options.seed * 0x2545f4914f6cdd1dull + 1;
  sleep_sequence = 0;
  streams_changed = true;
}

uint32_t Executor::NewAgent(AgentInfo info) {
  const uint32_t id = static_cast<uint32_t>(agents.size());
  if (info.record != 0) records[info.record].agents.push_back(id);
  agents.push_back(std::move(info));
  return id;
}

void JoinAgents(const std::vector<const Knowledge*>& agents, ClockRef* clock, ClockRef* async) {
  std::vector<ClockRef> known, known_async;
  std::vector<ClockEntry> own, own_async;
  for (const Knowledge* k : agents) {
    known.push_back(k->known);
    known_async.push_back(k->async_known);
    own.push_back({k->id, k->event});
    if (k->async_event != 0) own_async.push_back({k->id, k->async_event});
  }
  *clock = JoinAll(known, std::move(own));
  if (async != nullptr) *async = JoinAll(known_async, std::move(own_async));
}

void Executor::CompleteBarrier(BarrierGroup& group, const std::vector<Knowledge*>& members,
                               bool block) {
  ++group.count;
  std::vector<ClockRef> known, known_async;
  for (Knowledge* k : members) {
    known.push_back(k->known);
    known_async.push_back(k->async_known);
    AgentInfo& a = agents[k->id];
    (block ? a.block_events : a.warp_events).emplace_back(k->event, k->async_event);
  }
  const ClockRef joined = CompactLarge(JoinAll(known, {{group.id, group.count}}));
  const ClockRef joined_async = CompactLarge(JoinAll(known_async, {{group.async_id, group.count}}));
  for (Knowledge* k : members) {
    k->known = joined;
    k->async_known = joined_async;
    ++k->event;
  }
}

ClockRef Executor::Compact(const ClockRef& clock) const {
  if (!clock) return clock;
  // Per finished launch: how many of its accessing agents the clock knows up to their last
  // access.
  std::unordered_map<uint32_t, size_t> covered;
  for (const ClockEntry& e : *clock) {
    const AgentInfo& a = agents[e.id];
    if (a.record != 0 && records[a.record].summary != 0 && a.last_access != 0 &&
        e.event >= a.last_access) {
      ++covered[a.record];
    }
  }
  std::vector<uint32_t> whole;
  for (const auto& [record, count] : covered) {
    if (count >= records[record].accessing) whole.push_back(record);
  }
  if (whole.empty()) return clock;
  auto out = std::make_shared<Clock>();
  std::vector<ClockEntry> summaries;
  for (uint32_t record : whole) summaries.push_back({records[record].summary, 1});
  for (const ClockEntry& e : *clock) {
    const uint32_t record = agents[e.id].record;
    if (record != 0 && std::find(whole.begin(), whole.end(), record) != whole.end()) continue;
    out->push_back(e);
  }
  return JoinAll({out}, std::move(summaries));
}

HostStream* Executor::Stream(cudaStream_t stream) {
  return stream != nullptr ? stream : gpus[current_gpu].streams[0].get();
}

cudaError_t Executor::Enqueue(HostStream* stream, StreamOp op) {
  if (failed) return cudaErrorLaunchFailure;
  stream->ops.push_back(std::move(op));
  streams_changed = true;
  return cudaSuccess;
}

bool Executor::AllIdle() const {
  if (!blocks.empty() || !in_flight.empty()) return false;
  for (const Gpu& g : gpus) {
    for (const auto& s : g.streams) {
      if (!s->ops.empty()) return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------- scheduling

void Executor::RunUntil(const std::function<bool()>& done) {
  if (failed) return;
  while (!done()) {
    if (streams_changed) {
      streams_changed = false;
      StartStreams();
    }
    if (failed) break;
    if (!runnable.empty()) {
      if (!in_flight.empty() && Chance(options.copy_probability)) {
        PerformStage(in_flight[Pick(in_flight.size())]);
        if (failed) break;
      }
      Resume(runnable[Pick(runnable.size())]);
    } else if (!in_flight.empty()) {
      PerformStage(in_flight[Pick(in_flight.size())]);
    } else if (!sleepers.empty()) {
      // Everyone polls. With no write since the last time, only time can change anything: let
      // it pass faster and faster (a wait's timeout comes in a few thousand steps, not millions).
      const uint64_t wake = sleepers.front().wake_ns;
      if (progress == idle_progress) {
        idle_stretch_ns =
            std::min<uint64_t>(std::max<uint64_t>(2 * idle_stretch_ns, 1000), 1000000);
      } else {
        idle_stretch_ns = 0;
      }
      idle_progress = progress;
      now_ns = std::max(now_ns + idle_stretch_ns, wake);
      WakeSleepers();
    } else if (!blocks.empty()) {
      Fail([this] {
        return "deadlock: no thread can run; each blocked thread and what it waits for:" +
               ThreadsReport();
      });
    } else {
      break;  // nothing left to run
    }
    if (failed) break;
    if (++stats.steps > options.max_steps) {
      const int64_t limit = options.max_steps;
      Fail([this, limit] {
        return "hang: the kernels still run after " + std::to_string(limit) +
               " scheduler steps (virtual time " + std::to_string(now_ns) +
               " ns); where each thread is:" + ThreadsReport();
      });
      break;
    }
  }
  stats.virtual_ns = now_ns;
  if (failed) {
    if (failure) {
      std::string text = failure();
      failure = nullptr;
      throw Report("host executor (seed " + std::to_string(options.seed) + "): " + text);
    }
    return;
  }
  if (AllIdle()) ResetEpochs();
}

void Executor::Resume(Thread* t) {
  WakeSleepers();
  current = t;
  g_thread = t;
  t->fiber.SwitchTo();
  g_thread = nullptr;
  current = nullptr;
  ++stats.switches;
  now_ns += options.step_ns;
  if (t->state == ThreadState::kDone) {
    Block* b = t->block;
    if (b->live == 0 && !failed) FinishBlock(b);
  }
}

void Executor::WakeSleepers() {
  while (!sleepers.empty() && sleepers.front().wake_ns <= now_ns) {
    std::pop_heap(sleepers.begin(), sleepers.end(), std::greater<Sleeper>());
    Thread* t = sleepers.back().thread;
    sleepers.pop_back();
    Wake(t);
  }
}

void Executor::Point(Thread* t) {
  if (Chance(options.switch_probability)) t->fiber.Return();
}

void Executor::BlockOn(Thread* t, Wait wait) {
  t->state = ThreadState::kBlocked;
  t->wait = std::move(wait);
  Thread* last = runnable.back();
  runnable[t->runnable_slot] = last;
  last->runnable_slot = t->runnable_slot;
  runnable.pop_back();
  t->fiber.Return();
}

void Executor::Wake(Thread* t) {
  if (t->state == ThreadState::kRunnable || t->state == ThreadState::kDone) return;
  t->state = ThreadState::kRunnable;
  t->runnable_slot = runnable.size();
  runnable.push_back(t);
}

void Executor::Sleep(Thread* t, uint64_t ns) {
  t->wake_ns = now_ns + std::max<uint64_t>(ns, 1);
  t->state = ThreadState::kSleeping;
  t->wait = Wait{"__nanosleep", nullptr};
  Thread* last = runnable.back();
  runnable[t->runnable_slot] = last;
  last->runnable_slot = t->runnable_slot;
  runnable.pop_back();
  sleepers.push_back(Sleeper{t->wake_ns, sleep_sequence++, t});
  std::push_heap(sleepers.begin(), sleepers.end(), std::greater<Sleeper>());
  t->fiber.Return();
}

void Executor::Fail(std::function<std::string()> report) {
  if (!failed) {
    failed = true;
    failure = std::move(report);
  }
  if (g_thread != nullptr && current != nullptr) {
    Thread* t = current;
    t->state = ThreadState::kBlocked;
    t->wait = Wait{"(the run ended with a report)", nullptr};
    t->fiber.Return();  // never resumed
  }
}

}  // namespace jax_hybridep::host
