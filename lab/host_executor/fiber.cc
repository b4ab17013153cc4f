// Fibers (fiber.h): a minimal callee-saved register switch on x86-64 (glibc's swapcontext makes
// a signal-mask system call per switch, and a run switches millions of times), ucontext
// elsewhere.
#include "lab/host_executor/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <stdexcept>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace jax_hybridep::host {
namespace {

size_t PageBytes() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// Stacks of finished fibers, reused (a run starts tens of thousands of threads, launch after
// launch) until ReleaseSpareStacks.
std::vector<void*>& SpareStacks() {
  static auto* spare = new std::vector<void*>();
  return *spare;
}
constexpr size_t kMaxSpareStacks = 8192;

void* MapStack(size_t bytes) {
  if (!SpareStacks().empty()) {
    void* p = SpareStacks().back();
    SpareStacks().pop_back();
    return p;
  }
  const size_t guard = PageBytes();
  void* p = mmap(nullptr, bytes + guard, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("host executor: cannot map a fiber stack");
  mprotect(p, guard, PROT_NONE);
  return p;
}

void UnmapStack(void* stack, size_t bytes) {
  if (SpareStacks().size() < kMaxSpareStacks) {
    SpareStacks().push_back(stack);
  } else {
    munmap(stack, bytes + PageBytes());
  }
}

}  // namespace

void ReleaseSpareStacks() {
  for (void* p : SpareStacks()) munmap(p, Fiber::kStackBytes + PageBytes());
  SpareStacks().clear();
}

char* Fiber::StackLow() const { return static_cast<char*>(stack_); }
char* Fiber::StackHigh() const { return static_cast<char*>(stack_) + PageBytes() + kStackBytes; }

#if defined(__x86_64__)

extern "C" void hybridep_fiber_switch(void** save_sp, void* load_sp);
extern "C" void hybridep_fiber_trampoline();

// Saves rbp, rbx, r12-r15, MXCSR and the x87 control word on the current stack, stores the stack
// pointer, loads the other one and restores the same from it.
asm(R"(
  .text
  .globl hybridep_fiber_switch
  .type hybridep_fiber_switch, @function
hybridep_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size hybridep_fiber_switch, .-hybridep_fiber_switch

  .globl hybridep_fiber_trampoline
  .type hybridep_fiber_trampoline, @function
hybridep_fiber_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size hybridep_fiber_trampoline, .-hybridep_fiber_trampoline
)");

Fiber::~Fiber() {
  if (stack_ != nullptr) UnmapStack(stack_, kStackBytes);
}

void Fiber::Start(Entry entry, void* arg) {
  if (stack_ == nullptr) stack_ = MapStack(kStackBytes);
  auto* top = reinterpret_cast<uint64_t*>(static_cast<char*>(stack_) + PageBytes() + kStackBytes);
  // The frame hybridep_fiber_switch pops: control words, r15, r14, r13, r12, rbx, rbp, return
  // address. After the `ret` the stack pointer is `top` (16-byte aligned), as a call needs.
  uint64_t* sp = top - 8;
  uint32_t mxcsr = 0;
  uint16_t fpucw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  sp[0] = static_cast<uint64_t>(mxcsr) | (static_cast<uint64_t>(fpucw) << 32);
  sp[1] = 0;                                  // r15
  sp[2] = 0;                                  // r14
  sp[3] = reinterpret_cast<uint64_t>(entry);  // r13
  sp[4] = reinterpret_cast<uint64_t>(arg);    // r12
  sp[5] = 0;                                  // rbx
  sp[6] = 0;                                  // rbp
  sp[7] = reinterpret_cast<uint64_t>(&hybridep_fiber_trampoline);
  sp_ = sp;
}

void Fiber::SwitchTo() { hybridep_fiber_switch(&scheduler_sp_, sp_); }

void Fiber::Return() { hybridep_fiber_switch(&sp_, scheduler_sp_); }

#else  // ucontext

namespace {
struct Contexts {
  ucontext_t fiber;
  ucontext_t scheduler;
  Fiber::Entry entry;
  void* arg;
};
// makecontext passes int arguments only: the pointer travels as two halves.
void Run(unsigned high, unsigned low) {
  auto* c = reinterpret_cast<Contexts*>((static_cast<uintptr_t>(high) << 32) | low);
  c->entry(c->arg);
}
}  // namespace

Fiber::~Fiber() {
  delete static_cast<Contexts*>(context_);
  if (stack_ != nullptr) UnmapStack(stack_, kStackBytes);
}

void Fiber::Start(Entry entry, void* arg) {
  if (stack_ == nullptr) stack_ = MapStack(kStackBytes);
  if (context_ == nullptr) context_ = new Contexts();
  auto* c = static_cast<Contexts*>(context_);
  getcontext(&c->fiber);
  c->fiber.uc_stack.ss_sp = static_cast<char*>(stack_) + PageBytes();
  c->fiber.uc_stack.ss_size = kStackBytes;
  c->fiber.uc_link = nullptr;
  c->entry = entry;
  c->arg = arg;
  const auto bits = reinterpret_cast<uintptr_t>(c);
  makecontext(&c->fiber, reinterpret_cast<void (*)()>(&Run), 2, static_cast<unsigned>(bits >> 32),
              static_cast<unsigned>(bits & 0xffffffffu));
}

void Fiber::SwitchTo() {
  auto* c = static_cast<Contexts*>(context_);
  swapcontext(&c->scheduler, &c->fiber);
}

void Fiber::Return() {
  auto* c = static_cast<Contexts*>(context_);
  swapcontext(&c->fiber, &c->scheduler);
}

#endif

}  // namespace jax_hybridep::host
