// Vector clocks (clock.h).
#include "lab/host_executor/clock.h"

#include <algorithm>
#include <utility>

namespace jax_hybridep::host {

uint32_t Lookup(const ClockRef& clock, uint32_t id) {
  if (!clock) return 0;
  auto it = std::lower_bound(clock->begin(), clock->end(), id,
                             [](const ClockEntry& e, uint32_t v) { return e.id < v; });
  return it != clock->end() && it->id == id ? it->event : 0;
}

namespace {

// Recent joins by their operands: the 32 lanes of a warp acquiring one barrier phase from one
// shared clock get one result, so the next __syncwarp joins one clock instead of 32 equal ones.
struct JoinMemo {
  ClockRef a, b, result;
};
JoinMemo& MemoSlot(const Clock* a, const Clock* b) {
  static JoinMemo* slots = new JoinMemo[256];
  const uintptr_t h = reinterpret_cast<uintptr_t>(a) * 31 + reinterpret_cast<uintptr_t>(b);
  return slots[(h >> 4) % 256];
}

ClockRef Merge(const ClockRef& a, const ClockRef& b);

}  // namespace

ClockRef Join(const ClockRef& a, const ClockRef& b) {
  if (!a || a->empty() || a == b) return b ? b : a;
  if (!b || b->empty()) return a;
  JoinMemo& memo = MemoSlot(a.get(), b.get());
  if (memo.a == a && memo.b == b) return memo.result;
  ClockRef result = Merge(a, b);
  memo = JoinMemo{a, b, result};
  return result;
}

namespace {

ClockRef Merge(const ClockRef& a, const ClockRef& b) {
  auto out = std::make_shared<Clock>();
  out->reserve(std::max(a->size(), b->size()));
  auto i = a->begin(), j = b->begin();
  bool a_covers = true, b_covers = true;  // whether the join equals a (or b): share it then
  while (i != a->end() || j != b->end()) {
    if (j == b->end() || (i != a->end() && i->id < j->id)) {
      out->push_back(*i++);
      b_covers = false;
    } else if (i == a->end() || j->id < i->id) {
      out->push_back(*j++);
      a_covers = false;
    } else {
      if (i->event < j->event) a_covers = false;
      if (j->event < i->event) b_covers = false;
      out->push_back({i->id, std::max(i->event, j->event)});
      ++i, ++j;
    }
  }
  if (a_covers) return a;
  if (b_covers) return b;
  return out;
}

}  // namespace

ClockRef With(const ClockRef& clock, uint32_t id, uint32_t event) {
  if (Lookup(clock, id) >= event) return clock;
  auto out = clock ? std::make_shared<Clock>(*clock) : std::make_shared<Clock>();
  auto it = std::lower_bound(out->begin(), out->end(), id,
                             [](const ClockEntry& e, uint32_t v) { return e.id < v; });
  if (it != out->end() && it->id == id) {
    it->event = event;
  } else {
    out->insert(it, {id, event});
  }
  return out;
}

ClockRef JoinAll(const std::vector<ClockRef>& clocks, std::vector<ClockEntry> extra) {
  // Distinct clocks only (threads after a barrier share theirs), merged pairwise as a tree:
  // linear merges beat a heap for the few, long clocks a barrier joins.
  std::vector<ClockRef> level;
  for (const ClockRef& c : clocks) {
    if (!c || c->empty()) continue;
    if (std::find(level.begin(), level.end(), c) == level.end()) level.push_back(c);
  }
  if (!extra.empty()) {
    std::sort(extra.begin(), extra.end(),
              [](const ClockEntry& a, const ClockEntry& b) { return a.id < b.id; });
    auto own = std::make_shared<Clock>();
    for (const ClockEntry& e : extra) {
      if (e.event == 0) continue;
      if (!own->empty() && own->back().id == e.id) {
        own->back().event = std::max(own->back().event, e.event);
      } else {
        own->push_back(e);
      }
    }
    if (!own->empty()) level.push_back(std::move(own));
  }
  while (level.size() > 1) {
    std::vector<ClockRef> next;
    for (size_t i = 0; i + 1 < level.size(); i += 2) next.push_back(Merge(level[i], level[i + 1]));
    if (level.size() % 2 == 1) next.push_back(level.back());
    level.swap(next);
  }
  return level.empty() ? nullptr : level.front();
}

}  // namespace jax_hybridep::host
