// A thread's synchronising accesses to memory and to time, as the host executor performs them
// (cuda.h, ptx.h): atomics, fences, system-scope acquire/release flags, %globaltimer and
// __nanosleep. Each is a scheduling point and adds its happens-before edges to the clocks.
#include <cstdint>
#include <cstring>

#include "lab/host_executor/primitives.h"
#include "lab/host_executor/scheduler.h"

namespace jax_hybridep::host {

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
}  // namespace jax_hybridep::host
