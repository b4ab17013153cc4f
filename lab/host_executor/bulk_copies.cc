// mbarriers and the bulk copies that complete on them, as the host executor performs them
// (ptx.h): mbarrier init, arrive and try_wait with phases and tx-counts, cp.async.bulk between
// global and shared memory through the copy engine, commit and wait groups, proxy fences. Each
// checks its use against the PTX ISA's rules and adds its happens-before edges to the clocks.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lab/host_executor/primitives.h"
#include "lab/host_executor/scheduler.h"

namespace jax_hybridep::host {
namespace {

std::string Where(const Region* r, const void* p) {
  return r->name + " +" + std::to_string(static_cast<const char*>(p) - r->begin);
}

}  // namespace

// ---------------------------------------------------------------------------- mbarriers

namespace {

constexpr int64_t kMaxTx = (1 << 20) - 1;  // the tx-count's range is [-(2^20 - 1), 2^20 - 1]

// The mbarrier at `bar` in the current thread's block (null after a report).
Mbarrier* FindBarrier(Thread* t, uint64_t* bar, const char* op, const void* pc, bool initialised) {
  Executor& e = TheExecutor();
  const Region* r = e.memory.Find(bar);
  const uint32_t me = t->k.id;
  if (r == nullptr || r->kind != RegionKind::kShared || r->block != t->block ||
      reinterpret_cast<uintptr_t>(bar) % 8 != 0 || reinterpret_cast<char*>(bar) + 8 > r->end) {
    e.Fail([&e, me, op, pc] {
      return std::string("mbarrier misuse: ") + e.Describe(me) + " runs " + op + " at " +
             Symbolize(pc) +
             " on an address that is not an 8-byte aligned word of its block's "
             "shared memory";
    });
    return nullptr;
  }
  auto it = t->block->mbarriers.find(bar);
  if (initialised && it == t->block->mbarriers.end()) {
    const std::string where = Where(r, bar);
    e.Fail([&e, me, op, pc, where] {
      return std::string("mbarrier misuse: ") + e.Describe(me) + " runs " + op + " at " +
             Symbolize(pc) + " on " + where + ", which no mbarrier.init initialised";
    });
    return nullptr;
  }
  return it == t->block->mbarriers.end() ? nullptr : &it->second;
}

std::string BarrierState(const Mbarrier& m) {
  return "phase " + std::to_string(m.phase) + " (parity " + std::to_string(m.phase & 1) +
         "): " + std::to_string(m.pending) + " of " + std::to_string(m.expected) +
         " arrivals pending, tx-count " + std::to_string(m.tx);
}

}  // namespace

// Completes the barrier's phase when its arrivals and bytes are all in.
void CheckPhase(Mbarrier& m, const void* bar, const void* pc) {
  Executor& e = TheExecutor();
  if (m.pending != 0) return;
  if (m.tx < 0) {
    const std::string where = Where(m.region, bar), state = BarrierState(m);
    const int64_t extra = -m.tx;
    e.Fail([where, state, extra, pc] {
      return "mbarrier tx-count underflow: " + where + " received " + std::to_string(extra) +
             " bytes more than its arrivals expected (" + state + "), last at " + Symbolize(pc);
    });
    return;
  }
  if (m.tx > 0) return;
  const uint32_t parity = m.phase & 1;
  m.completed_clock[parity] = m.phase_clock;
  m.completed_async[parity] = m.phase_async;
  m.phase_clock = nullptr;
  m.phase_async = nullptr;
  ++m.phase;
  m.pending = m.expected;
  std::vector<std::pair<Thread*, uint32_t>> still;
  for (auto& [t, want] : m.waiters) {
    if (want == parity) {
      e.Wake(t);
    } else {
      still.emplace_back(t, want);
    }
  }
  m.waiters = std::move(still);
}

void MbarrierInit(uint64_t* bar, uint32_t count) {
  const void* pc = __builtin_return_address(0);
  Thread* t = Self("mbarrier.init");
  Executor& e = TheExecutor();
  e.Point(t);
  const uint32_t me = t->k.id;
  if (count < 1 || count > kMaxTx) {
    e.Fail([&e, me, pc, count] {
      return "mbarrier misuse: " + e.Describe(me) + " initialises an mbarrier at " + Symbolize(pc) +
             " with count " + std::to_string(count) + " (1 to 2^20 - 1)";
    });
  }
  FindBarrier(t, bar, "mbarrier.init", pc, false);
  auto& table = t->block->mbarriers;
  auto it = table.find(bar);
  if (it != table.end() && !it->second.waiters.empty()) {
    e.Fail([&e, me, pc] {
      return "mbarrier misuse: " + e.Describe(me) + " re-initialises an mbarrier at " +
             Symbolize(pc) + " while threads wait on it";
    });
  }
  // A plain write: the barrier's users must be ordered after it (fence.mbarrier_init and a
  // __syncthreads), or the race detector says so.
  e.Access(t->k, nullptr, bar, 8, true, false, pc, t->block);
  Mbarrier& m = table[bar];
  m = Mbarrier();
  m.expected = m.pending = count;
  m.region = e.memory.Find(bar);
  std::memset(bar, 0, 8);
}

void FenceMbarrierInit() { Fence(FenceScope::kBlock); }

void MbarrierArrive(uint64_t* bar, uint32_t expect_bytes) {
  const void* pc = __builtin_return_address(0);
  Thread* t = Self("mbarrier.arrive");
  Executor& e = TheExecutor();
  e.Point(t);
  Mbarrier* m =
      FindBarrier(t, bar, expect_bytes ? "mbarrier.arrive.expect_tx" : "mbarrier.arrive", pc, true);
  if (m == nullptr) return;
  e.Access(t->k, nullptr, bar, 8, true, true, pc, t->block);
  m->tx += expect_bytes;
  if (m->tx > kMaxTx) {
    const std::string where = Where(m->region, bar), state = BarrierState(*m);
    const uint32_t me = t->k.id;
    e.Fail([&e, me, pc, where, state] {
      return "mbarrier tx-count overflow: " + e.Describe(me) + " expects bytes on " + where +
             " at " + Symbolize(pc) + " past 2^20 - 1 (" + state + ")";
    });
    return;
  }
  m->phase_clock = Join(m->phase_clock, t->k.Snapshot());
  m->phase_async = Join(m->phase_async, t->k.AsyncSnapshot());
  ++t->k.event;
  --m->pending;
  CheckPhase(*m, bar, pc);
}

bool MbarrierTryWaitParity(uint64_t* bar, uint32_t parity) {
  const void* pc = __builtin_return_address(0);
  Thread* t = Self("mbarrier.try_wait");
  Executor& e = TheExecutor();
  e.Point(t);
  Mbarrier* m = FindBarrier(t, bar, "mbarrier.try_wait.parity", pc, true);
  if (m == nullptr) return false;
  e.Access(t->k, nullptr, bar, 8, false, true, pc, t->block);
  parity &= 1;
  // The phase of parity `parity` has completed when the current phase has the other parity.
  if ((m->phase & 1) == parity) {
    m->waiters.emplace_back(t, parity);
    const std::string where = Where(m->region, bar);
    Block* block = t->block;
    e.BlockOn(t, Wait{"mbarrier.try_wait.parity " + std::to_string(parity) + " on " + where, pc,
                      [block, bar] {
                        auto it = block->mbarriers.find(bar);
                        return it == block->mbarriers.end() ? std::string("no mbarrier")
                                                            : BarrierState(it->second);
                      }});
    m = &t->block->mbarriers.at(bar);
  }
  Acquire(t->k, m->completed_clock[parity], m->completed_async[parity]);
  return true;
}

// ---------------------------------------------------------------------------- bulk copies

namespace {

// Checks a bulk copy's operands; false after a report.
bool CheckBulk(Thread* t, const char* what, const void* shared, const void* global, uint32_t bytes,
               const void* pc) {
  Executor& e = TheExecutor();
  const uint32_t me = t->k.id;
  auto fail = [&](std::string why) {
    e.Fail([&e, me, what, pc, why] {
      return std::string("bulk copy misuse: ") + e.Describe(me) + " issues " + what + " at " +
             Symbolize(pc) + ": " + why;
    });
    return false;
  };
  if (bytes == 0 || bytes % 16 != 0) {
    return fail(std::to_string(bytes) + " bytes, not a positive multiple of 16");
  }
  if (reinterpret_cast<uintptr_t>(shared) % 16 != 0) {
    return fail("its shared-memory address is not 16-byte aligned");
  }
  if (reinterpret_cast<uintptr_t>(global) % 16 != 0) {
    return fail("its global address is not 16-byte aligned");
  }
  const Region* s = e.memory.Find(shared);
  if (s == nullptr || s->kind != RegionKind::kShared || s->block != t->block ||
      static_cast<const char*>(shared) + bytes > s->end) {
    const std::string where = s == nullptr ? "untracked memory" : s->name;
    return fail("its shared-memory range of " + std::to_string(bytes) + " bytes is not inside " +
                "one shared allocation of this block (" + where + "): shared memory out of bounds");
  }
  const Region* g = e.memory.Find(global);
  if (g == nullptr || (g->kind != RegionKind::kGlobal && g->kind != RegionKind::kMapped) ||
      static_cast<const char*>(global) + bytes > g->end) {
    return fail("its global range of " + std::to_string(bytes) +
                " bytes is not inside one allocation: global memory out of bounds");
  }
  return true;
}

BulkOp* NewOp(Thread* t, bool load, char* dst, const char* src, uint32_t bytes, const void* pc) {
  Executor& e = TheExecutor();
  auto op = std::make_unique<BulkOp>();
  op->load = load;
  op->dst = dst;
  op->src = src;
  op->bytes = bytes;
  op->block = t->block;
  op->launch = t->block->launch;
  op->issuer = t->k.id;
  op->pc = pc;
  AgentInfo info;
  info.kind = AgentInfo::kBulkCopy;
  info.gpu = e.agents[t->k.id].gpu;
  info.record = op->launch->record;
  info.issuer = t->k.id;
  info.pc = pc;
  info.what = std::string("cp.async.bulk ") + (load ? "global->shared" : "shared->global") +
              " of " + std::to_string(bytes) + " bytes";
  op->k.id = e.NewAgent(info);
  op->k.known = t->k.AsyncSnapshot();
  op->k.async_known = op->k.known;
  // Its writes need not be async-visible over reads ordered before its issue (a consumer's reads
  // of a stage, then an mbarrier, then the producer's bulk load into it: no proxy fence).
  op->generic.id = op->k.id;
  op->generic.event = 2;
  op->generic.known = t->k.Snapshot();
  ++t->k.event;
  // Its destination is undefined until the copy lands: poisoned, and any access before then
  // a report.
  Region* r = e.memory.Find(dst);
  const size_t at = static_cast<size_t>(dst - r->begin);
  for (uint32_t i = 0; i < bytes; ++i) {
    ByteShadow& b = r->shadow[at + i];
    if (b.pending != 0) {
      const uint32_t other = b.pending, me = op->k.id;
      const std::string where = Where(r, dst + i);
      e.Fail([&e, me, other, where] {
        return "data race on " + where + ": " + e.Describe(me) + " and " + e.Describe(other) +
               " are both in flight into it";
      });
      return nullptr;
    }
    b.pending = op->k.id;
  }
  std::memset(dst, Memory::kPoison, bytes);
  ++op->launch->pending_ops;
  ++e.stats.bulk_copies;
  BulkOp* raw = op.get();
  op->launch->ops.push_back(std::move(op));
  return raw;
}

}  // namespace

void BulkLoad(void* shared, const void* global, uint32_t bytes, uint64_t* bar) {
  const void* pc = __builtin_return_address(0);
  Thread* t = Self("cp.async.bulk");
  Executor& e = TheExecutor();
  e.Point(t);
  if (!CheckBulk(t, "cp.async.bulk global->shared", shared, global, bytes, pc)) return;
  if (FindBarrier(t, bar, "cp.async.bulk ... mbarrier::complete_tx", pc, true) == nullptr) return;
  BulkOp* op =
      NewOp(t, true, static_cast<char*>(shared), static_cast<const char*>(global), bytes, pc);
  if (op == nullptr) return;
  op->bar = bar;
  e.in_flight.push_back(op);
}

void BulkStore(void* global, const void* shared, uint32_t bytes) {
  const void* pc = __builtin_return_address(0);
  Thread* t = Self("cp.async.bulk");
  Executor& e = TheExecutor();
  e.Point(t);
  if (!CheckBulk(t, "cp.async.bulk shared->global", shared, global, bytes, pc)) return;
  BulkOp* op =
      NewOp(t, false, static_cast<char*>(global), static_cast<const char*>(shared), bytes, pc);
  if (op == nullptr) return;
  t->open_group.push_back(op);
  e.in_flight.push_back(op);
}

void BulkCommit() {
  Thread* t = Self("cp.async.bulk.commit_group");
  TheExecutor().Point(t);
  t->committed.push_back(std::move(t->open_group));
  t->open_group.clear();
}

bool Executor::GroupsDone(const Thread* t, size_t count, bool read_only) {
  for (size_t g = 0; g < count; ++g) {
    for (const BulkOp* op : t->committed[g]) {
      if (!(read_only ? op->read_done : op->write_done)) return false;
    }
  }
  return true;
}

void BulkWait(int pending, bool read_only) {
  const void* pc = __builtin_return_address(0);
  Thread* t = Self("cp.async.bulk.wait_group");
  Executor& e = TheExecutor();
  e.Point(t);
  const size_t n = t->committed.size();
  const size_t count = n > static_cast<size_t>(pending) ? n - pending : 0;
  while (!Executor::GroupsDone(t, count, read_only)) {
    e.bulk_waiters.push_back(t);
    e.BlockOn(t, Wait{std::string("cp.async.bulk.wait_group") + (read_only ? ".read " : " ") +
                          std::to_string(pending),
                      pc, nullptr});
  }
  for (size_t g = read_only ? t->read_waited : 0; g < count; ++g) {
    for (const BulkOp* op : t->committed[g]) {
      if (read_only) {
        // Reads of shared memory done: the stage may be written again (no proxy fence needed).
        t->k.known = With(t->k.known, op->k.id, 1);
        t->k.async_known = With(t->k.async_known, op->k.id, 1);
      } else {
        // Writes done, as the async proxy sees them: generic accesses (a flag) need
        // fence.proxy.async next.
        t->k.async_known = Join(t->k.async_known, op->k.Snapshot());
      }
    }
  }
  if (read_only) {
    t->read_waited = std::max(t->read_waited, count);
  } else {
    t->committed.erase(t->committed.begin(), t->committed.begin() + count);
    t->read_waited = t->read_waited > count ? t->read_waited - count : 0;
  }
}

void FenceProxyAsync(ProxyFenceSpace) {
  Thread* t = Self("fence.proxy.async");
  TheExecutor().Point(t);
  // Generic and async proxy accesses ordered both ways: the two views become one.
  t->k.known = Join(t->k.known, t->k.async_known);
  t->k.async_known = t->k.known;
  t->k.async_event = t->k.event;
  ++t->k.event;
}

void Executor::RecheckBulkWaiters() {
  std::vector<Thread*> still;
  for (Thread* t : bulk_waiters) {
    if (t->state == ThreadState::kBlocked) Wake(t);  // it re-checks its groups itself
  }
  bulk_waiters.swap(still);
}

void Executor::PerformStage(BulkOp* op) {
  if (!op->read_done) {
    op->k.event = 1;
    Access(op->k, nullptr, op->src, op->bytes, false, false, op->pc,
           op->load ? nullptr : op->block);
    if (failed) return;
    op->data.assign(op->src, op->src + op->bytes);
    op->read_done = true;
    if (!op->load) RecheckBulkWaiters();
    return;
  }
  op->k.event = 2;
  Access(op->k, &op->generic, op->dst, op->bytes, true, false, op->pc,
         op->load ? op->block : nullptr);
  if (failed) return;
  std::memcpy(op->dst, op->data.data(), op->bytes);
  Region* r = memory.Find(op->dst);
  const size_t at = static_cast<size_t>(op->dst - r->begin);
  for (uint32_t i = 0; i < op->bytes; ++i) {
    if (r->shadow[at + i].pending == op->k.id) r->shadow[at + i].pending = 0;
  }
  op->write_done = true;
  in_flight.erase(std::find(in_flight.begin(), in_flight.end(), op));
  --op->launch->pending_ops;
  if (op->load) {
    auto it = op->block->mbarriers.find(op->bar);
    if (it != op->block->mbarriers.end()) {
      Mbarrier& m = it->second;
      m.tx -= op->bytes;
      m.phase_clock = Join(m.phase_clock, op->k.Snapshot());
      m.phase_async = Join(m.phase_async, op->k.Snapshot());
      CheckPhase(m, op->bar, op->pc);
    }
  } else {
    RecheckBulkWaiters();
  }
  MaybeFinishLaunch(op->launch);
}
}  // namespace jax_hybridep::host
