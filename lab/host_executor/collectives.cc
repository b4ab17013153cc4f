// The device primitives a block's threads perform together, as the host executor performs them
// (cuda.h): the built-in variables, __syncthreads, the warp collectives (shuffles, ballots,
// __syncwarp) and the block's shared memory. Each is a scheduling point, checks its use against
// the PTX ISA's rules and adds its happens-before edges to the clocks.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "lab/host_executor/primitives.h"
#include "lab/host_executor/scheduler.h"

namespace jax_hybridep::host {
namespace {

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%08llx", static_cast<unsigned long long>(v));
  return buf;
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
  if (c.kind == WarpCollective::kMatch) return "__match_any_sync";
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
    } else if (c.kind == WarpCollective::kMatch) {
      uint64_t same = 0;  // the lanes of the mask holding this lane's value
      for (int o = 0; o < 32; ++o) {
        if ((c.mask >> o & 1) && c.value[o] == c.value[l]) same |= 1ull << o;
      }
      t->collective_result = same;
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

unsigned MatchAny(unsigned mask, uint64_t bits) {
  return static_cast<unsigned>(Collective(WarpCollective::kMatch, ShuffleKind::kIndex, mask, bits,
                                          0, 32, __builtin_return_address(0)));
}

void SyncWarp(unsigned mask) {
  Collective(WarpCollective::kSync, ShuffleKind::kIndex, mask, 0, 0, 32,
             __builtin_return_address(0));
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
