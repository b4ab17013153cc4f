// What the host executor checks and reports (scheduler.h): every memory access a kernel makes,
// against its allocation's bounds, bulk copies in flight and the vector clocks of earlier
// accesses (races), and the descriptions of threads and agents its reports name.
#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "lab/host_executor/init_tracking.h"
#include "lab/host_executor/scheduler.h"

namespace jax_hybridep::host {

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
  CheckTracked(*this, k, r, p, bytes, write, pc);  // initcheck, peer access
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
