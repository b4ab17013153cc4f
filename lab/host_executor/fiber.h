// Fibers: the host executor runs every CUDA thread as a fiber on one OS thread and switches
// between them only where a thread synchronises, waits or polls, so a run is a pure function of
// its seed. A fiber's stack has a guard page below it (an overflow faults, never corrupts).
#ifndef JAX_HYBRIDEP_LAB_HOST_EXECUTOR_FIBER_H_
#define JAX_HYBRIDEP_LAB_HOST_EXECUTOR_FIBER_H_

#include <cstddef>
#include <vector>

namespace jax_hybridep::host {

// Unmaps the stacks kept for reuse (each a guard page and a stack: two mappings). A process
// that goes on after a run (pytest compiling XLA programs) needs them back: Executor::Reset.
void ReleaseSpareStacks();

class Fiber {
 public:
  using Entry = void (*)(void* arg);

  Fiber() = default;
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
  ~Fiber();

  // Prepares the fiber to run entry(arg) on its own stack at the first SwitchTo.
  void Start(Entry entry, void* arg);
  // From the scheduler's context into the fiber, until it calls Return().
  void SwitchTo();
  // From the fiber back to the scheduler's context.
  void Return();
  // The fiber's stack (accesses there are the thread's own locals).
  char* StackLow() const;
  char* StackHigh() const;

  static constexpr size_t kStackBytes = 128 << 10;

 private:
  void* stack_ = nullptr;  // mapping: guard page, then kStackBytes
  void* sp_ = nullptr;     // the fiber's saved stack pointer (x86-64 switch)
  void* scheduler_sp_ = nullptr;
  void* context_ = nullptr;  // ucontext pair elsewhere
};

}  // namespace jax_hybridep::host

#endif  // JAX_HYBRIDEP_LAB_HOST_EXECUTOR_FIBER_H_
