// A window's regions at their offsets (window_layout.h).
#include "xla_ffi/cuda/window_layout.h"

#include <cstddef>
#include <cstdint>

#include "xla_ffi/limits.h"

namespace jax_hybridep {
namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

struct WindowOffsets {
  size_t payload[2], row_pos[2], values[2], arrived, error_claim, total;
};

WindowOffsets Offsets(const WindowGeometry& g) {
  const size_t slots = static_cast<size_t>(g.ranks * g.tokens);
  const size_t payload = AlignUp(slots * RowStride(g.row_bytes));
  const size_t meta = AlignUp(slots * g.k * sizeof(int32_t));
  WindowOffsets o{};
  size_t at = 0;
  for (int p = 0; p < 2; ++p) {
    o.payload[p] = at;
    at += payload;
    o.row_pos[p] = at;
    at += meta;
    o.values[p] = at;
    at += meta;
  }
  o.arrived = at;
  at += AlignUp(static_cast<size_t>(g.ranks * kMaxSendBlocks) * sizeof(uint64_t));
  o.error_claim = at;
  at += kAlign;
  o.total = at;
  return o;
}

}  // namespace

size_t WindowBytes(const WindowGeometry& geometry) { return Offsets(geometry).total; }

Window CarveWindow(char* base, const WindowGeometry& geometry) {
  const WindowOffsets o = Offsets(geometry);
  Window w;
  for (int p = 0; p < 2; ++p) {
    w.payload[p] = base + o.payload[p];
    w.row_pos[p] = reinterpret_cast<int32_t*>(base + o.row_pos[p]);
    w.values[p] = reinterpret_cast<float*>(base + o.values[p]);
  }
  w.arrived = reinterpret_cast<uint64_t*>(base + o.arrived);
  w.error_claim = reinterpret_cast<uint32_t*>(base + o.error_claim);
  return w;
}

}  // namespace jax_hybridep
