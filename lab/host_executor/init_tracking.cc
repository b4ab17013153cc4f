// Initialisation per byte of cudaMalloc'd memory and the GPUs' peer access (init_tracking.h).
//
// Why: the kernels have zeroing and initialisation duties of their own (a padding row, the
// slot map's counters), and a harness that zero-fills every buffer makes a dropped one invisible;
// on a GPU, memory from cudaMalloc holds whatever it held before. So global memory starts
// poisoned (memory.cc) and uninitialised here, and only what writes it (a kernel's store or
// atomic, a bulk copy, a memset, a memcpy from initialised bytes) makes it readable. Peer access
// is per (GPU, peer) and must be enabled on the GPU that reaches out, as on the hardware.
#include "lab/host_executor/init_tracking.h"

#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lab/host_executor/scheduler.h"

namespace jax_hybridep::host {
namespace {

struct Tracking {
  // Per byte of each cudaMalloc'd allocation (by its start): 1 once something wrote it.
  std::unordered_map<const char*, std::vector<uint8_t>> written;
  std::set<std::pair<int, int>> peers;  // (GPU, peer) pairs enabled
  // The last allocation looked up: neighbouring accesses mostly hit the same one.
  const char* last_begin = nullptr;
  std::vector<uint8_t>* last = nullptr;
};

Tracking& T() {
  static Tracking* tracking = new Tracking();  // never destroyed, like the executor
  return *tracking;
}

std::vector<uint8_t>* Written(const char* begin) {
  Tracking& t = T();
  if (begin == t.last_begin) return t.last;
  auto it = t.written.find(begin);
  t.last_begin = begin;
  t.last = it == t.written.end() ? nullptr : &it->second;
  return t.last;
}

std::string Where(const Region* r, const char* p) {
  return r->name + " +" + std::to_string(p - r->begin) + " (GPU " + std::to_string(r->gpu) + ")";
}

}  // namespace

void TrackInitialisation(const void* begin, size_t bytes) {
  Tracking& t = T();
  t.written[static_cast<const char*>(begin)].assign(bytes, 0);
  t.last_begin = nullptr;
}

void ForgetInitialisation(const void* begin) {
  Tracking& t = T();
  t.written.erase(static_cast<const char*>(begin));
  t.last_begin = nullptr;
}

bool EnablePeerAccess(int gpu, int peer) { return T().peers.emplace(gpu, peer).second; }

void ResetTracking() {
  Tracking& t = T();
  t.written.clear();
  t.peers.clear();
  t.last_begin = nullptr;
  t.last = nullptr;
}

void CheckTracked(Executor& e, const Knowledge& k, const Region* r, const char* p, size_t bytes,
                  bool write, const void* pc) {
  if (r->kind != RegionKind::kGlobal || e.failed) return;
  const AgentInfo& a = e.agents[k.id];
  const bool device = a.kind == AgentInfo::kThread || a.kind == AgentInfo::kBulkCopy;
  const uint32_t id = k.id;
  if (device && r->gpu != a.gpu && !T().peers.count({a.gpu, r->gpu})) {
    const std::string where = Where(r, p);
    const int gpu = a.gpu, peer = r->gpu;
    e.Fail([&e, id, write, bytes, where, pc, gpu, peer] {
      return "peer access not enabled: " + e.Describe(id) + (write ? " writes " : " reads ") +
             std::to_string(bytes) + " bytes at " + where + " at " + Symbolize(pc) +
             ": memory of GPU " + std::to_string(peer) + ", which GPU " + std::to_string(gpu) +
             " never enabled with cudaDeviceEnablePeerAccess(" + std::to_string(peer) +
             ") (a GPU faults here)";
    });
    return;
  }
  std::vector<uint8_t>* written = Written(r->begin);
  if (written == nullptr) return;
  uint8_t* at = written->data() + (p - r->begin);
  if (write) {
    std::memset(at, 1, bytes);
    return;
  }
  if (!device) return;  // a memcpy's source: CopyInitialisation carries it
  size_t first = bytes, unwritten = 0;
  for (size_t i = 0; i < bytes; ++i) {
    if (at[i] != 0) continue;
    if (first == bytes) first = i;
    ++unwritten;
  }
  if (unwritten == 0) return;
  const std::string where = Where(r, p + first);
  e.Fail([&e, id, bytes, unwritten, where, pc] {
    return "uninitialised global memory read (initcheck): " + e.Describe(id) + " reads " +
           std::to_string(bytes) + " bytes at " + Symbolize(pc) + ", " + std::to_string(unwritten) +
           " of which (the first at " + where + ") nothing wrote since their cudaMalloc";
  });
}

void CopyInitialisation(char* dst, const char* src, size_t bytes) {
  Executor& e = TheExecutor();
  const Region* from = e.memory.Find(src);
  const Region* to = e.memory.Find(dst);
  if (from == nullptr || to == nullptr) return;
  std::vector<uint8_t>* source = Written(from->begin);
  const uint8_t* src_bits = source == nullptr ? nullptr : source->data() + (src - from->begin);
  if (src_bits == nullptr) return;  // untracked source: the write initialised dst already
  std::vector<uint8_t>* target = Written(to->begin);
  if (target == nullptr) return;
  std::memmove(target->data() + (dst - to->begin), src_bits, bytes);
}

}  // namespace jax_hybridep::host
