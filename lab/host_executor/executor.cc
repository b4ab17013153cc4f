// The host executor's scheduler, grids, streams, race detector and reports (executor.h).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <utility>

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

// ---------------------------------------------------------------------------- grids

namespace {

void ThreadMain(void* arg) {
  auto* t = static_cast<Thread*>(arg);
  Executor& e = TheExecutor();
  t->block->launch->body->Run();
  // The kernel returned: this thread has exited.
  t->state = ThreadState::kDone;
  Block* b = t->block;
  b->launch->kept.push_back(std::make_unique<Knowledge>(t->k));
  b->launch->finals.push_back(b->launch->kept.back().get());
  Warp& w = b->warps[t->warp];
  w.live &= ~(1u << t->lane);
  --b->live;
  Thread* last = e.runnable.back();
  e.runnable[t->runnable_slot] = last;
  last->runnable_slot = t->runnable_slot;
  e.runnable.pop_back();
  // A lane a pending warp collective names has exited: it can never complete.
  for (const WarpCollective& c : w.pending) {
    if (c.mask & (1u << t->lane)) {
      const uint32_t who = t->k.id;
      const void* pc = c.pc;
      e.Fail([&e, who, pc] {
        return "warp collective with an exited lane: " + e.Describe(who) +
               " exited while other lanes of its mask wait at " + Symbolize(pc);
      });
    }
  }
  // Exited threads no longer count at __syncthreads.
  if (!b->barrier_waiters.empty() && b->arrived == b->live) CompleteBlockBarrier(b);
  t->fiber.Return();  // never resumed
}

}  // namespace

void Executor::StartStreams() {
  for (int g = 0; g < static_cast<int>(gpus.size()); ++g) {
    for (auto& s : gpus[g].streams) {
      while (!s->ops.empty() && !s->running) {
        StreamOp& op = s->ops.front();
        if (op.kind == StreamOp::kLaunch) {
          op.launch->base = s->base;
          op.launch->record = static_cast<uint32_t>(records.size());
          records.emplace_back();
          s->running = true;
          ++stats.launches;
        } else {
          PerformMemoryOp(s.get(), op);
          if (failed) return;
          s->ops.pop_front();
        }
      }
    }
    // Free SMs take the next blocks of the running launches, streams in order.
    for (auto& s : gpus[g].streams) {
      if (!s->running) continue;
      Launch* launch = s->ops.front().launch.get();
      while (gpus[g].free_slots > 0 && launch->next_block < launch->blocks_total) {
        --gpus[g].free_slots;
        StartBlock(launch, g);
      }
      MaybeFinishLaunch(launch);
    }
  }
}

void Executor::StartBlock(Launch* launch, int gpu) {
  auto block = std::make_unique<Block>();
  Block* b = block.get();
  b->launch = launch;
  b->linear = static_cast<int>(launch->next_block++);
  const unsigned gx = launch->grid.x, gy = launch->grid.y;
  b->index = uint3{b->linear % gx, (b->linear / gx) % gy, b->linear / (gx * gy)};
  const int n = static_cast<int>(launch->block.x * launch->block.y * launch->block.z);
  b->live = n;
  b->warps.resize((n + 31) / 32);
  AgentInfo group_info;
  group_info.kind = AgentInfo::kLaunch;
  group_info.gpu = gpu;
  group_info.kernel = launch->kernel;
  group_info.record = launch->record;
  auto new_group = [&] {
    groups.emplace_back();
    groups.back().id = NewAgent(group_info);
    groups.back().async_id = NewAgent(group_info);
    return &groups.back();
  };
  b->group = new_group();
  for (Warp& w : b->warps) w.group = new_group();
  // Zero bytes too: an extern __shared__ array of a launch without dynamic shared memory is
  // then a red zone.
  b->dynamic =
      memory.Allocate(launch->smem, 128, RegionKind::kShared, gpu, b, "dynamic shared memory");
  for (int i = 0; i < n; ++i) {
    auto t = std::make_unique<Thread>();
    t->block = b;
    t->linear = i;
    const unsigned bx = launch->block.x, by = launch->block.y;
    t->index = uint3{i % bx, (i / bx) % by, i / (bx * by)};
    t->warp = i / 32;
    t->lane = i % 32;
    b->warps[t->warp].live |= 1u << t->lane;
    AgentInfo info;
    info.kind = AgentInfo::kThread;
    info.gpu = gpu;
    info.kernel = launch->kernel;
    info.block = b->index;
    info.thread = t->index;
    info.warp = t->warp;
    info.lane = t->lane;
    info.record = launch->record;
    info.block_group = b->group;
    info.warp_group = b->warps[t->warp].group;
    t->k.id = NewAgent(info);
    t->k.known = launch->base;
    t->k.async_known = launch->base;
    t->fiber.Start(&ThreadMain, t.get());
    t->stack_low = t->fiber.StackLow();
    t->stack_high = t->fiber.StackHigh();
    t->runnable_slot = runnable.size();
    runnable.push_back(t.get());
    b->threads.push_back(std::move(t));
    ++stats.threads;
  }
  blocks.push_back(std::move(block));
}

void Executor::FinishBlock(Block* b) {
  Launch* launch = b->launch;
  // Bulk copies that still need the block's shared memory.
  for (const BulkOp* op : in_flight) {
    if (op->block != b) continue;
    const bool needs = op->load ? !op->write_done : !op->read_done;
    if (!needs) continue;
    const std::string issuer = Describe(op->issuer);
    const void* pc = op->pc;
    const bool load = op->load;
    Fail([issuer, pc, load] {
      return std::string("bulk copy outlives its block: ") +
             (load ? "a cp.async.bulk into shared memory" : "a cp.async.bulk from shared memory") +
             " issued by " + issuer + " at " + Symbolize(pc) +
             " was still in flight when the block exited" +
             (load ? " (nobody waited for its mbarrier)"
                   : " (no cp.async.bulk.wait_group.read before the exit)");
    });
    return;
  }
  for (Region* r : b->statics) memory.Free(r->begin);
  memory.Free(b->dynamic->begin);
  ++launch->blocks_done;
  ++gpus[launch->gpu].free_slots;
  streams_changed = true;
  auto it = std::find_if(blocks.begin(), blocks.end(),
                         [b](const std::unique_ptr<Block>& p) { return p.get() == b; });
  blocks.erase(it);
  MaybeFinishLaunch(launch);
}

void Executor::MaybeFinishLaunch(Launch* launch) {
  if (launch->blocks_done < launch->blocks_total || launch->pending_ops > 0) return;
  HostStream* s = launch->stream;
  if (!s->running || s->ops.empty() || s->ops.front().launch.get() != launch) return;
  for (const auto& op : launch->ops) launch->finals.push_back(&op->k);
  ClockRef finished;
  JoinAgents(launch->finals, &finished, nullptr);
  AgentInfo info;
  info.kind = AgentInfo::kLaunch;
  info.gpu = launch->gpu;
  info.kernel = launch->kernel;
  LaunchRecord& record = records[launch->record];
  record.summary = NewAgent(info);
  for (uint32_t id : record.agents) record.accessing += agents[id].last_access != 0;
  s->base = Compact(With(Join(s->base, finished), records[launch->record].summary, 1));
  s->running = false;
  s->ops.pop_front();
  streams_changed = true;
}

void Executor::PerformMemoryOp(HostStream* s, StreamOp& op) {
  AgentInfo info;
  info.kind = AgentInfo::kStreamOp;
  info.gpu = s->gpu;
  info.what = op.kind == StreamOp::kMemset ? "cudaMemsetAsync" : "cudaMemcpyAsync";
  Knowledge k;
  k.id = NewAgent(info);
  k.known = s->base;
  if (op.kind == StreamOp::kMemcpy) {
    Access(k, nullptr, op.src, op.bytes, false, false, nullptr, nullptr);
  }
  Access(k, nullptr, op.dst, op.bytes, true, false, nullptr, nullptr);
  if (failed) return;
  if (op.kind == StreamOp::kMemset) {
    std::memset(op.dst, op.value, op.bytes);
  } else {
    std::memmove(op.dst, op.src, op.bytes);
  }
  s->base = Join(s->base, k.Snapshot());
}

void Executor::ResetEpochs() {
  memory.ResetEpochs();
  agents.assign(1, AgentInfo());
  records.assign(1, LaunchRecord());
  groups.clear();
  sync_vars.clear();
  for (Gpu& g : gpus) {
    for (auto& s : g.streams) s->base = nullptr;
  }
}

// ---------------------------------------------------------------------------- memory checks

namespace {

std::string Offset(const Region* r, const void* p) {
  std::ostringstream s;
  s << r->name << " +" << (static_cast<const char*>(p) - r->begin);
  if (r->kind != RegionKind::kShared) s << " (GPU " << r->gpu << ")";
  return s.str();
}

const char* AccessName(bool write, bool relaxed) {
  if (relaxed) return write ? "atomic write" : "atomic read";
  return write ? "write" : "read";
}

}  // namespace

void Executor::Access(Knowledge& k, const Knowledge* read_view, const void* address, size_t bytes,
                      bool write, bool relaxed, const void* pc, const Block* block) {
  if (bytes == 0 || failed) return;
  ++stats.accesses;
  Region* r = memory.Find(address);
  if (r == nullptr) return;  // the stack, the kernel's parameters: not tracked
  const char* p = static_cast<const char*>(address);
  const uint32_t id = k.id;
  if (r->kind == RegionKind::kRedZone || p + bytes > r->end) {
    const Region* a = r->kind == RegionKind::kRedZone ? r->guarded : r;
    const int64_t offset = p - a->begin;
    const std::string where =
        a->name + " (" + std::to_string(a->end - a->begin) + " bytes" +
        (a->kind == RegionKind::kShared ? "" : ", GPU " + std::to_string(a->gpu)) + ")";
    const char* kind = AccessName(write, relaxed);
    Fail([=] {
      return std::string(a->kind == RegionKind::kShared ? "shared" : "global") +
             " memory out of bounds: " + Describe(id) + " " + kind + "s " + std::to_string(bytes) +
             " bytes at offset " + std::to_string(offset) + " of " + where + " at " + Symbolize(pc);
    });
    return;
  }
  if (r->kind == RegionKind::kShared && block != nullptr && r->block != block) {
    Fail([=] {
      return "shared memory out of bounds: " + Describe(id) + " accesses another block's " +
             r->name + " at " + Symbolize(pc);
    });
    return;
  }
  if (write) ++progress;
  r->touched = true;
  agents[id].last_access = k.event;
  const size_t at = static_cast<size_t>(p - r->begin);
  // Neighbouring bytes mostly share their last access: one clock lookup for them all.
  uint32_t memo_id = 0, memo_event = 0;
  bool memo_known = true;
  auto knows = [&](uint32_t other, uint32_t event) {
    if (other != memo_id || event != memo_event) {
      memo_id = other;
      memo_event = event;
      memo_known = Knows(k, other, event);
    }
    return memo_known;
  };
  const Knowledge& reader_view = read_view != nullptr ? *read_view : k;
  auto knows_read = [&](uint32_t other, uint32_t event) {
    return read_view == nullptr ? knows(other, event) : Knows(reader_view, other, event);
  };
  for (size_t i = 0; i < bytes; ++i) {
    ByteShadow& s = r->shadow[at + i];
    if (s.pending != 0 && s.pending != id) {
      const uint32_t copy = s.pending;
      const std::string where = Offset(r, p + i);
      const bool shared = r->kind == RegionKind::kShared;
      Fail([=] {
        return std::string(write ? "write to" : "read of") +
               " a bulk copy's destination before the copy completed" +
               (shared ? " (before its mbarrier phase completed)" : "") + ": " + Describe(id) +
               " at " + Symbolize(pc) + " " + (write ? "writes " : "reads ") + where + ", which " +
               Describe(copy) + " has not written yet";
      });
      return;
    }
    if (!options.detect_races) continue;
    auto race = [&](uint32_t other, const void* other_pc, bool other_write, bool other_relaxed) {
      const std::string where = Offset(r, p + i);
      const char* mine = AccessName(write, relaxed);
      const char* theirs = AccessName(other_write, other_relaxed);
      Fail([=] {
        auto at = [](const void* where_pc) {
          return where_pc == nullptr ? std::string() : " at " + Symbolize(where_pc);
        };
        return "data race on " + where + ": " + Describe(id) + " " + mine + "s it" + at(pc) + "; " +
               Describe(other) + " " + theirs + "s it" + at(other_pc) +
               "; neither happens before the other";
      });
    };
    const bool write_relaxed = (s.flags & kWriteRelaxed) != 0;
    if (s.w_id != 0 && !(relaxed && write_relaxed) && !knows(s.w_id, s.w_event)) {
      race(s.w_id, s.w_pc, true, write_relaxed);
      return;
    }
    char* byte = r->begin + at + i;
    if (write) {
      if (s.flags & kMoreReaders) {
        for (const Reader& reader : memory.readers[byte]) {
          if (!(relaxed && reader.relaxed) && !knows_read(reader.id, reader.event)) {
            race(reader.id, reader.pc, false, reader.relaxed);
            return;
          }
        }
        memory.readers.erase(byte);
      } else if (s.r_id != 0 && !(relaxed && (s.flags & kReadRelaxed)) &&
                 !knows_read(s.r_id, s.r_event)) {
        race(s.r_id, s.r_pc, false, (s.flags & kReadRelaxed) != 0);
        return;
      }
      s.w_id = id;
      s.w_event = k.event;
      s.w_pc = pc;
      s.r_id = 0;
      s.flags = relaxed ? kWriteRelaxed : 0;
    } else if (s.flags & kMoreReaders) {
      // Reads not ordered with each other (a word every lane reads). A read that happens before
      // another in the list is redundant for the checks of later writes: pruned when the list
      // has doubled since the last pruning, so a byte read by n threads costs O(n) in all.
      auto& readers = memory.readers[byte];
      if (!readers.empty() && readers.back().id == id) {
        readers.back() = Reader{id, k.event, pc, relaxed};
      } else {
        readers.push_back(Reader{id, k.event, pc, relaxed});
      }
      if (readers.size() >= 8 && (readers.size() & (readers.size() - 1)) == 0) {
        readers.erase(std::remove_if(readers.begin(), readers.end() - 1,
                                     [&](const Reader& o) { return Knows(k, o.id, o.event); }),
                      readers.end() - 1);
      }
    } else if (s.r_id == 0 || s.r_id == id || knows(s.r_id, s.r_event)) {
      s.r_id = id;
      s.r_event = k.event;
      s.r_pc = pc;
      s.flags = static_cast<uint8_t>((s.flags & ~kReadRelaxed) | (relaxed ? kReadRelaxed : 0));
    } else {
      memory.readers[byte] = {Reader{s.r_id, s.r_event, s.r_pc, (s.flags & kReadRelaxed) != 0},
                              Reader{id, k.event, pc, relaxed}};
      s.r_id = 0;
      s.flags |= kMoreReaders;
    }
  }
}

void OnAccess(const void* address, size_t bytes, bool write, bool relaxed, const void* pc) {
  Thread* t = g_thread;
  const char* p = static_cast<const char*>(address);
  if (p >= t->stack_low && p < t->stack_high) return;
  Executor& e = TheExecutor();
  e.Access(t->k, nullptr, address, bytes, write, relaxed, pc, t->block);
  if (relaxed) {
    // A volatile access: a relaxed atomic at system scope (PTX ld.volatile / st.volatile).
    SyncVar& v = e.sync_vars[address];
    if (write) {
      v.clock = Join(v.clock, t->k.fence_release);
    } else {
      t->k.relaxed_acquired = Join(t->k.relaxed_acquired, v.clock);
    }
  }
}

// ---------------------------------------------------------------------------- reports

std::string Executor::DescribeThread(const Thread* t) const { return Describe(t->k.id); }

std::string Executor::Describe(uint32_t agent) const {
  if (agent == 0 || agent >= agents.size()) return "an earlier operation";
  const AgentInfo& a = agents[agent];
  std::ostringstream s;
  switch (a.kind) {
    case AgentInfo::kThread:
      s << "GPU " << a.gpu << " " << KernelName(a.kernel) << " block (" << a.block.x << ","
        << a.block.y << "," << a.block.z << ") thread " << a.thread.x;
      if (a.thread.y || a.thread.z) s << "," << a.thread.y << "," << a.thread.z;
      s << " (warp " << a.warp << " lane " << a.lane << ")";
      break;
    case AgentInfo::kBulkCopy:
      s << "the " << a.what << " issued by " << Describe(a.issuer) << " at " << Symbolize(a.pc);
      break;
    case AgentInfo::kStreamOp:
      s << a.what << " on GPU " << a.gpu;
      break;
  }
  return s.str();
}

std::string Executor::ThreadsReport() const {
  // Threads grouped by (kernel launch, block, warp, what they wait for), lanes listed compactly.
  std::map<std::string, std::vector<int>> groups;
  std::vector<std::string> order;
  for (const auto& b : blocks) {
    for (const auto& t : b->threads) {
      if (t->state == ThreadState::kDone) continue;
      const AgentInfo& a = agents[t->k.id];
      std::ostringstream key;
      key << "GPU " << a.gpu << " " << KernelName(a.kernel) << " block (" << a.block.x << ","
          << a.block.y << "," << a.block.z << ") warp " << a.warp << " ";
      key << "\x01";
      key << (t->state == ThreadState::kSleeping ? "polls (in __nanosleep)" : t->wait.what);
      if (t->wait.pc != nullptr) key << " at " << Symbolize(t->wait.pc);
      if (t->wait.state) key << " [" << t->wait.state() << "]";
      const std::string k = key.str();
      if (!groups.count(k)) order.push_back(k);
      groups[k].push_back(t->lane);
    }
  }
  std::ostringstream s;
  for (const std::string& k : order) {
    const std::vector<int>& lanes = groups.at(k);
    const size_t cut = k.find('\x01');
    s << "\n  " << k.substr(0, cut) << (lanes.size() == 1 ? "lane " : "lanes ");
    for (size_t i = 0; i < lanes.size();) {
      size_t j = i;
      while (j + 1 < lanes.size() && lanes[j + 1] == lanes[j] + 1) ++j;
      if (i > 0) s << ",";
      s << lanes[i];
      if (j > i) s << "-" << lanes[j];
      i = j + 1;
    }
    s << ": " << k.substr(cut + 1);
  }
  return s.str();
}

}  // namespace jax_hybridep::host
