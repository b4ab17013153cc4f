// The host executor's memory (memory.h).
#include "lab/host_executor/memory.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace jax_hybridep::host {

Region* Memory::Allocate(size_t bytes, size_t align, RegionKind kind, int gpu, const void* block,
                         std::string name) {
  align = align < 16 ? 16 : align;
  const size_t zone = (kRedZone + align - 1) / align * align;
  const size_t total = zone + (bytes + align - 1) / align * align + zone;
  void* raw = std::aligned_alloc(align, total);
  if (raw == nullptr) return nullptr;
  char* base = static_cast<char*>(raw);
  char* begin = base + zone;
  std::memset(begin, kPoison, bytes);
  Allocation a{raw, {}};
  char* bounds[4] = {base, begin, begin + bytes, base + total};
  for (int i = 0; i < 3; ++i) {
    auto r = std::make_unique<Region>();
    r->begin = bounds[i];
    r->end = bounds[i + 1];
    r->kind = i == 1 ? kind : RegionKind::kRedZone;
    r->gpu = gpu;
    r->block = block;
    r->name = name;
    a.regions[i] = std::move(r);
  }
  Region* data = a.regions[1].get();
  data->shadow.resize(bytes);
  a.regions[0]->guarded = a.regions[2]->guarded = data;
  for (auto& r : a.regions) {
    if (r->end > r->begin) regions_[reinterpret_cast<uintptr_t>(r->begin)] = r.get();
  }
  allocations_.emplace(begin, std::move(a));
  return data;
}

bool Memory::Free(const void* begin) {
  auto it = allocations_.find(begin);
  if (it == allocations_.end()) return false;
  for (auto& r : it->second.regions) {
    if (!readers.empty()) {
      for (char* p = r->begin; p < r->end; ++p) readers.erase(p);
    }
    auto at = regions_.find(reinterpret_cast<uintptr_t>(r->begin));
    if (at != regions_.end() && at->second == r.get()) regions_.erase(at);
  }
  std::free(it->second.raw);
  allocations_.erase(it);
  return true;
}

Region* Memory::Find(const void* p) const {
  const auto at = reinterpret_cast<uintptr_t>(p);
  auto it = regions_.upper_bound(at);
  if (it == regions_.begin()) return nullptr;
  --it;
  Region* r = it->second;
  return at < reinterpret_cast<uintptr_t>(r->end) ? r : nullptr;
}

void Memory::ResetEpochs() {
  for (auto& [begin, region] : regions_) {
    if (!region->touched) continue;
    region->touched = false;
    for (ByteShadow& b : region->shadow) {
      const uint32_t pending = b.pending;
      b = ByteShadow();
      b.pending = pending;
    }
  }
  readers.clear();
}

void Memory::Clear() {
  while (!allocations_.empty()) Free(allocations_.begin()->first);
  regions_.clear();
  readers.clear();
}

}  // namespace jax_hybridep::host
