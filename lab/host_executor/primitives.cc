// The device primitives as the host executor performs them (cuda.h, ptx.h): built-in variables,
// __syncthreads, the warp collectives, atomics and fences, %globaltimer and __nanosleep,
// acquire/release flags, mbarriers, bulk copies and shared memory. Each is a scheduling point,
// checks its use against the PTX ISA's rules and adds its happens-before edges to the clocks.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>

#include "lab/host_executor/scheduler.h"

namespace jax_hybridep::host {
namespace {

Thread* Self(const char* what) {
  Thread* t = g_thread;
  if (t == nullptr) {
    throw std::logic_error(std::string("host executor: ") + what + " outside a kernel thread");
  }
  return t;
}

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%08llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string Where(const Region* r, const void* p) {
  return r->name + " +" + std::to_string(static_cast<const char*>(p) - r->begin);
}

// Acquire: `k` learns what the clocks carry.
void Acquire(Knowledge& k, const ClockRef& clock, const ClockRef& async) {
  k.known = Join(k.known, clock);
  k.async_known = Join(k.async_known, async);
}

}  // namespace

uint3 ThreadIdx() { return Self("threadIdx")->index; }
uint3 BlockIdx() { return Self("blockIdx")->block->index; }
dim3 BlockDim() { return Self("blockDim")->block->launch->block; }
dim3 GridDim() { return Self("gridDim")->block->launch->grid; }

// ---------------------------------------------------------------------------- __syncthreads

void CompleteBlockBarrier(Block* b) {
  Executor& e = TheExecutor();
  std::vector<Knowledge*> members;
  for (Thread* o : b->barrier_waiters) members.push_back(&o->k);
  e.CompleteBarrier(*b->group, members, true);
  const uint64_t result = static_cast<uint64_t>(b->barrier_and) |
                          static_cast<uint64_t>(b->barrier_or) << 1 |
                          static_cast<uint64_t>(b->barrier_count) << 2;
  for (Thread* o : b->barrier_waiters) {
    o->collective_result = result;
    e.Wake(o);
  }
  b->barrier_waiters.clear();
  b->arrived = 0;
  b->barrier_pc = nullptr;
  b->barrier_and = 1;
  b->barrier_or = 0;
  b->barrier_count = 0;
}

int SyncThreads(BarrierReduce reduce, int predicate) {
  const void* pc = __builtin_return_address(0);
  Thread* t = Self("__syncthreads");
  Executor& e = TheExecutor();
  e.Point(t);
  Block* b = t->block;
  if (!b->barrier_waiters.empty() && b->barrier_pc != pc) {
    const uint32_t me = t->k.id, other = b->barrier_waiters.front()->k.id;
    const void* other_pc = b->barrier_pc;
    const int waiting = static_cast<int>(b->barrier_waiters.size());
    e.Fail([&e, me, other, pc, other_pc, waiting] {
      return "divergent __syncthreads: " + e.Describe(me) + " reaches the barrier at " +
             Symbolize(pc) + " while " + std::to_string(waiting) + " thread(s) of its block (" +
             e.Describe(other) + " first) wait at the barrier at " + Symbolize(other_pc);
    });
  }
  b->barrier_pc = pc;
  ++b->arrived;
  b->barrier_and &= predicate != 0;
  b->barrier_or |= predicate != 0;
  b->barrier_count += predicate != 0;
  b->barrier_waiters.push_back(t);
  if (b->arrived == b->live) {
    CompleteBlockBarrier(b);
  } else {
    e.BlockOn(t, Wait{"__syncthreads", pc, [b] {
                        return std::to_string(b->arrived) + " of " + std::to_string(b->live) +
                               " live threads of the block arrived";
                      }});
  }
  const uint64_t r = t->collective_result;
  switch (reduce) {
    case BarrierReduce::kAnd:
      return static_cast<int>(r & 1);
    case BarrierReduce::kOr:
      return static_cast<int>((r >> 1) & 1);
    case BarrierReduce::kCount:
      return static_cast<int>(r >> 2);
    case BarrierReduce::kNone:
      break;
  }
  return 0;
}

// ---------------------------------------------------------------------------- warp collectives

namespace {

const char* CollectiveName(const WarpCollective& c) {
  if (c.kind == WarpCollective::kBallot) return "__ballot_sync";
  if (c.kind == WarpCollective::kSync) return "__syncwarp";
  switch (c.shuffle) {
    case ShuffleKind::kIndex:
      return "__shfl_sync";
    case ShuffleKind::kXor:
      return "__shfl_xor_sync";
    case ShuffleKind::kUp:
      return "__shfl_up_sync";
    case ShuffleKind::kDown:
      return "__shfl_down_sync";
  }
  return "a warp collective";
}

// The lane whose value lane `lane` gets (its own when the source falls outside its segment).
int SourceLane(const WarpCollective& c, int lane) {
  const int width = c.width, first = lane & ~(width - 1), op = c.operand[lane];
  switch (c.shuffle) {
    case ShuffleKind::kIndex:
      return first + (op & (width - 1));
    case ShuffleKind::kXor: {
      const int src = lane ^ op;
      return src >= first && src < first + width ? src : lane;
    }
    case ShuffleKind::kUp:
      return lane - op >= first ? lane - op : lane;
    case ShuffleKind::kDown:
      return lane + op < first + width ? lane + op : lane;
  }
  return lane;
}

void Complete(Executor& e, WarpCollective& c) {
  if (c.kind == WarpCollective::kSync) {
    std::vector<Knowledge*> members;
    for (int l = 0; l < 32; ++l) {
      if (c.mask >> l & 1) members.push_back(&c.lanes[l]->k);
    }
    Warp& w = c.lanes[__builtin_ctz(c.mask)]->block->warps[c.lanes[__builtin_ctz(c.mask)]->warp];
    if (c.mask == w.live) {
      e.CompleteBarrier(*w.group, members, false);
    } else {  // a partial __syncwarp: every member's own event
      std::vector<const Knowledge*> agents(members.begin(), members.end());
      ClockRef joined, joined_async;
      JoinAgents(agents, &joined, &joined_async);
      for (Knowledge* k : members) {
        k->known = joined;
        k->async_known = joined_async;
        ++k->event;
      }
    }
  }
  uint64_t ballot = 0;
  for (int l = 0; l < 32; ++l) {
    if ((c.mask >> l & 1) && c.value[l] != 0) ballot |= 1ull << l;
  }
  for (int l = 0; l < 32; ++l) {
    if (!(c.mask >> l & 1)) continue;
    Thread* t = c.lanes[l];
    if (c.kind == WarpCollective::kShuffle) {
      const int src = SourceLane(c, l);
      if (!(c.mask >> src & 1)) {
        const uint32_t me = t->k.id;
        const void* pc = c.pc;
        const unsigned mask = c.mask;
        const char* name = CollectiveName(c);
        e.Fail([&e, me, pc, mask, name, src] {
          return std::string("shuffle mask: ") + e.Describe(me) + " reads lane " +
                 std::to_string(src) + " in " + name + " at " + Symbolize(pc) +
                 ", outside its mask " + Hex(mask) + " (the value is undefined)";
        });
        return;
      }
      t->collective_result = c.value[src];
    } else {
      t->collective_result = ballot;
    }
    e.Wake(t);
  }
}

uint64_t Collective(WarpCollective::Kind kind, ShuffleKind shuffle, unsigned mask, uint64_t value,
                    int operand, int width, const void* pc) {
  Thread* t = Self("a warp collective");
  Executor& e = TheExecutor();
  e.Point(t);
  WarpCollective probe{};
  probe.kind = kind;
  probe.shuffle = shuffle;
  const char* name = CollectiveName(probe);
  const unsigned bit = 1u << t->lane;
  Warp& w = t->block->warps[t->warp];
  const uint32_t me = t->k.id;
  if (!(mask & bit)) {
    e.Fail([&e, me, pc, mask, name] {
      return std::string("shuffle mask: ") + e.Describe(me) + " calls " + name + " at " +
             Symbolize(pc) + " with mask " + Hex(mask) + ", which leaves out its own lane";
    });
  }
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    e.Fail([&e, me, pc, width, name] {
      return std::string("warp collective: ") + e.Describe(me) + " calls " + name + " at " +
             Symbolize(pc) + " with width " + std::to_string(width) + " (a power of two up to 32)";
    });
  }
  if (mask & ~w.live) {
    const unsigned gone = mask & ~w.live;
    e.Fail([&e, me, pc, mask, gone, name] {
      return std::string("shuffle mask: ") + e.Describe(me) + " calls " + name + " at " +
             Symbolize(pc) + " with mask " + Hex(mask) + ", which names lanes " + Hex(gone) +
             " that have exited or do not exist";
    });
  }
  WarpCollective* c = nullptr;
  for (WarpCollective& p : w.pending) {
    if (!(p.mask & bit)) continue;
    if (p.kind != kind || p.shuffle != shuffle || p.mask != mask || p.pc != pc) {
      const unsigned arrived = p.arrived, other_mask = p.mask;
      const void* other_pc = p.pc;
      const char* other_name = CollectiveName(p);
      e.Fail([&e, me, pc, mask, name, arrived, other_mask, other_pc, other_name] {
        return std::string("divergent warp collective: ") + e.Describe(me) + " reaches " + name +
               " with mask " + Hex(mask) + " at " + Symbolize(pc) + " while lanes " + Hex(arrived) +
               " wait at " + other_name + " with mask " + Hex(other_mask) + " at " +
               Symbolize(other_pc);
      });
    }
    c = &p;
    break;
  }
  if (c == nullptr) {
    w.pending.push_back(probe);
    c = &w.pending.back();
    c->mask = mask;
    c->width = width;
    c->pc = pc;
  }
  c->value[t->lane] = value;
  c->operand[t->lane] = operand;
  c->lanes[t->lane] = t;
  c->arrived |= bit;
  if (c->arrived == c->mask) {
    Complete(e, *c);
    w.pending.erase(w.pending.begin() + (c - w.pending.data()));
  } else {
    Warp* warp = &w;
    e.BlockOn(t, Wait{name, pc, [warp, mask] {
                        for (const WarpCollective& p : warp->pending) {
                          if (p.mask == mask) {
                            return "mask " + Hex(mask) + ", lanes " + Hex(p.arrived) +
                                   " arrived, live lanes " + Hex(warp->live);
                          }
                        }
                        return std::string("mask ") + Hex(mask);
                      }});
  }
  return t->collective_result;
}

}  // namespace

uint64_t Shuffle(unsigned mask, uint64_t bits, ShuffleKind kind, int operand, int width) {
  return Collective(WarpCollective::kShuffle, kind, mask, bits, operand, width,
                    __builtin_return_address(0));
}

unsigned Ballot(unsigned mask, int predicate) {
  return static_cast<unsigned>(Collective(WarpCollective::kBallot, ShuffleKind::kIndex, mask,
                                          predicate != 0, 0, 32, __builtin_return_address(0)));
}

void SyncWarp(unsigned mask) {
  Collective(WarpCollective::kSync, ShuffleKind::kIndex, mask, 0, 0, 32,
             __builtin_return_address(0));
}

// ---------------------------------------------------------------------------- atomics, fences

namespace {

// A relaxed read-modify-write of `bytes` at `address` by the current thread.
template <typename F>
uint64_t ReadModifyWrite(void* address, int bytes, const void* pc, F&& update) {
  Thread* t = Self("an atomic");
  Executor& e = TheExecutor();
  e.Point(t);
  e.Access(t->k, nullptr, address, static_cast<size_t>(bytes), false, true, pc, t->block);
  e.Access(t->k, nullptr, address, static_cast<size_t>(bytes), true, true, pc, t->block);
  SyncVar& v = e.sync_vars[address];
  t->k.relaxed_acquired = Join(t->k.relaxed_acquired, v.clock);
  v.clock = Join(v.clock, t->k.fence_release);
  uint64_t old = 0;
  std::memcpy(&old, address, static_cast<size_t>(bytes));
  const uint64_t next = update(old);
  std::memcpy(address, &next, static_cast<size_t>(bytes));
  return old;
}

int64_t Signed(uint64_t v, int bytes) {
  return bytes == 4 ? static_cast<int64_t>(static_cast<int32_t>(v)) : static_cast<int64_t>(v);
}

}  // namespace

uint64_t Atomic(AtomicOp op, void* address, int bytes, uint64_t operand, uint64_t compare,
                bool is_signed) {
  const void* pc = __builtin_return_address(0);
  const uint64_t mask = bytes == 4 ? 0xffffffffull : ~0ull;
  operand &= mask;
  compare &= mask;
  return ReadModifyWrite(address, bytes, pc, [&](uint64_t old) -> uint64_t {
    switch (op) {
      case AtomicOp::kAdd:
        return (old + operand) & mask;
      case AtomicOp::kMax:
        if (is_signed) return Signed(operand, bytes) > Signed(old, bytes) ? operand : old;
        return operand > old ? operand : old;
      case AtomicOp::kMin:
        if (is_signed) return Signed(operand, bytes) < Signed(old, bytes) ? operand : old;
        return operand < old ? operand : old;
      case AtomicOp::kExch:
        return operand;
      case AtomicOp::kCas:
        return old == compare ? operand : old;
      case AtomicOp::kAnd:
        return old & operand;
      case AtomicOp::kOr:
        return old | operand;
    }
    return old;
  });
}

float AtomicAddFloat(float* address, float value) {
  const uint64_t old = ReadModifyWrite(address, 4, __builtin_return_address(0), [&](uint64_t o) {
    float f;
    const uint32_t bits = static_cast<uint32_t>(o);
    std::memcpy(&f, &bits, 4);
    f = f + value;
    uint32_t out;
    std::memcpy(&out, &f, 4);
    return static_cast<uint64_t>(out);
  });
  float f;
  const uint32_t bits = static_cast<uint32_t>(old);
  std::memcpy(&f, &bits, 4);
  return f;
}

void Fence(FenceScope) {
  Thread* t = Self("a fence");
  TheExecutor().Point(t);
  // Acquire what relaxed reads saw since the last fence, then publish everything so far to the
  // relaxed writes that follow (C++ fence semantics; every scope alike here).
  t->k.known = Join(t->k.known, t->k.relaxed_acquired);
  t->k.relaxed_acquired = nullptr;
  t->k.fence_release = t->k.Snapshot();
  ++t->k.event;
}

void NanoSleep(unsigned ns) {
  Thread* t = Self("__nanosleep");
  TheExecutor().Sleep(t, ns);
}

uint64_t GlobalTimer() {
  Thread* t = Self("%globaltimer");
  Executor& e = TheExecutor();
  e.Point(t);
  return e.now_ns;
}

uint64_t LoadAcquire(const uint64_t* flag) {
  const void* pc = __builtin_return_address(0);
  Thread* t = Self("ld.acquire");
  Executor& e = TheExecutor();
  e.Point(t);
  e.Access(t->k, nullptr, flag, 8, false, true, pc, t->block);
  const SyncVar& v = e.sync_vars[flag];
  Acquire(t->k, v.clock, v.async);
  t->k.known = e.CompactLarge(t->k.known);
  t->k.async_known = e.CompactLarge(t->k.async_known);
  uint64_t value;
  std::memcpy(&value, flag, 8);
  return value;
}

void StoreRelease(uint64_t* flag, uint64_t value) {
  const void* pc = __builtin_return_address(0);
  Thread* t = Self("st.release");
  Executor& e = TheExecutor();
  e.Point(t);
  // The store is part of what it releases (so a clock holding the release knows every access of
  // this thread: Executor::Compact).
  e.Access(t->k, nullptr, flag, 8, true, true, pc, t->block);
  SyncVar& v = e.sync_vars[flag];
  v.clock = Join(v.clock, t->k.Snapshot());
  v.async = Join(v.async, t->k.AsyncSnapshot());
  ++t->k.event;
  std::memcpy(flag, &value, 8);
}

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

// ---------------------------------------------------------------------------- shared memory

void* StaticShared(const char* name, size_t bytes, size_t align) {
  Thread* t = Self("a __shared__ declaration");
  Executor& e = TheExecutor();
  Block* b = t->block;
  const size_t n = static_cast<size_t>(t->shared_declarations++);
  if (n < b->statics.size()) {
    if (b->static_names[n] != name) {
      const uint32_t me = t->k.id;
      const std::string first = b->static_names[n], mine = name;
      e.Fail([&e, me, first, mine] {
        return "divergent __shared__ declarations: " + e.Describe(me) + " declares `" + mine +
               "` where the block's other threads declared `" + first + "`";
      });
    }
    return b->statics[n]->begin;
  }
  Region* r = e.memory.Allocate(bytes, align, RegionKind::kShared, e.agents[t->k.id].gpu, b,
                                std::string("__shared__ ") + name);
  b->statics.push_back(r);
  b->static_names.push_back(name);
  return r->begin;
}

void* DynamicShared(size_t) {
  Thread* t = Self("extern __shared__");
  return t->block->dynamic->begin;
}

}  // namespace jax_hybridep::host
