// The compiler's ThreadSanitizer instrumentation, served by the host executor instead of
// libtsan: kernel sources compiled with -fsanitize=thread (and tsan-distinguish-volatile) call
// these for every memory access they make, and the executor checks each against its shadow
// memory (executor.h). Outside a kernel thread (the launchers' code in the same files) they
// do nothing. The runtime itself is built without instrumentation.
#include <cstddef>

#include "lab/host_executor/scheduler.h"

namespace hx = jax_hybridep::host;

#define JAX_HYBRIDEP_ACCESS(name, bytes, write, relaxed)                         \
  extern "C" void name(void* address) {                                          \
    if (hx::g_thread != nullptr) {                                               \
      hx::OnAccess(address, bytes, write, relaxed, __builtin_return_address(0)); \
    }                                                                            \
  }
#define JAX_HYBRIDEP_SIZES(prefix, write, relaxed)  \
  JAX_HYBRIDEP_ACCESS(prefix##1, 1, write, relaxed) \
  JAX_HYBRIDEP_ACCESS(prefix##2, 2, write, relaxed) \
  JAX_HYBRIDEP_ACCESS(prefix##4, 4, write, relaxed) \
  JAX_HYBRIDEP_ACCESS(prefix##8, 8, write, relaxed) \
  JAX_HYBRIDEP_ACCESS(prefix##16, 16, write, relaxed)

JAX_HYBRIDEP_SIZES(__tsan_read, false, false)
JAX_HYBRIDEP_SIZES(__tsan_write, true, false)
JAX_HYBRIDEP_SIZES(__tsan_unaligned_read, false, false)
JAX_HYBRIDEP_SIZES(__tsan_unaligned_write, true, false)
// PTX treats ld.volatile / st.volatile as relaxed operations at system scope.
JAX_HYBRIDEP_SIZES(__tsan_volatile_read, false, true)
JAX_HYBRIDEP_SIZES(__tsan_volatile_write, true, true)
JAX_HYBRIDEP_SIZES(__tsan_unaligned_volatile_read, false, true)
JAX_HYBRIDEP_SIZES(__tsan_unaligned_volatile_write, true, true)

#undef JAX_HYBRIDEP_SIZES
#undef JAX_HYBRIDEP_ACCESS

extern "C" {

void __tsan_init() {}

void __tsan_read_range(void* address, size_t bytes) {
  if (hx::g_thread != nullptr) {
    hx::OnAccess(address, bytes, false, false, __builtin_return_address(0));
  }
}

void __tsan_write_range(void* address, size_t bytes) {
  if (hx::g_thread != nullptr) {
    hx::OnAccess(address, bytes, true, false, __builtin_return_address(0));
  }
}

void __tsan_func_entry(void* call_site) {
  if (hx::g_thread != nullptr) hx::g_thread->frames.push_back(call_site);
}

void __tsan_func_exit() {
  if (hx::g_thread != nullptr && !hx::g_thread->frames.empty()) hx::g_thread->frames.pop_back();
}

void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}

}  // extern "C"

// std:: atomics in the instrumented files are the launchers' code (shared_ptr reference counts of a
// launch's parameters), never a kernel's: performed as asked, unchecked. Memory orders are the
// ThreadSanitizer ABI's (0 relaxed ... 5 seq_cst); seq_cst serves them all.
#define JAX_HYBRIDEP_ATOMICS(bits, type)                                                          \
  extern "C" type __tsan_atomic##bits##_load(const volatile type* a, int) {                       \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                  \
  }                                                                                               \
  extern "C" void __tsan_atomic##bits##_store(volatile type* a, type v, int) {                    \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                     \
  }                                                                                               \
  extern "C" type __tsan_atomic##bits##_exchange(volatile type* a, type v, int) {                 \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                           \
  }                                                                                               \
  extern "C" type __tsan_atomic##bits##_fetch_add(volatile type* a, type v, int) {                \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                               \
  extern "C" type __tsan_atomic##bits##_fetch_sub(volatile type* a, type v, int) {                \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                               \
  extern "C" type __tsan_atomic##bits##_fetch_and(volatile type* a, type v, int) {                \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                               \
  extern "C" type __tsan_atomic##bits##_fetch_or(volatile type* a, type v, int) {                 \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                               \
  extern "C" type __tsan_atomic##bits##_fetch_xor(volatile type* a, type v, int) {                \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                               \
  extern "C" int __tsan_atomic##bits##_compare_exchange_strong(volatile type* a, type* c, type v, \
                                                               int, int) {                        \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);       \
  }                                                                                               \
  extern "C" int __tsan_atomic##bits##_compare_exchange_weak(volatile type* a, type* c, type v,   \
                                                             int, int) {                          \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);       \
  }                                                                                               \
  extern "C" type __tsan_atomic##bits##_compare_exchange_val(volatile type* a, type c, type v,    \
                                                             int, int) {                          \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);             \
    return c;                                                                                     \
  }
JAX_HYBRIDEP_ATOMICS(8, unsigned char)
JAX_HYBRIDEP_ATOMICS(16, unsigned short)
JAX_HYBRIDEP_ATOMICS(32, unsigned int)
JAX_HYBRIDEP_ATOMICS(64, unsigned long long)
#undef JAX_HYBRIDEP_ATOMICS

extern "C" {
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) {}

}  // extern "C"
