// A window's regions (window_regions.h): two halves of ranks * items payload slots, the flags of
// every (source, send block), the exchange counter and the error claim, each 256-byte aligned.
#include "xla_ffi/cuda/state/window_regions.h"

#include <cstdint>

namespace jax_hybridep {
namespace {
constexpr int64_t kAlign = 256;
int64_t AlignUp(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
}  // namespace

WindowRegions WindowRegionsFor(const WindowGeometry& geometry) {
  WindowRegions w{};
  w.slot_stride = (geometry.row_bytes + 15) / 16 * 16;
  w.slots = geometry.ranks * geometry.items;
  int64_t at = 0;
  for (int p = 0; p < 2; ++p) {
    w.payload[p] = at;
    at += AlignUp(w.slots * w.slot_stride);
  }
  w.arrived = at;
  at += AlignUp(geometry.ranks * kMaxSendBlocks * static_cast<int64_t>(sizeof(uint64_t)));
  w.epoch = at;
  w.done = at + 8;
  w.error_claim = at + 16;
  at += kAlign;
  w.total = at;
  return w;
}

size_t WindowBytes(const WindowGeometry& geometry) {
  return static_cast<size_t>(WindowRegionsFor(geometry).total);
}

}  // namespace jax_hybridep
