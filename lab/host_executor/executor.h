// The host executor (docs/host_executor.md): CUDA kernels compiled by the C++ compiler run on
// the CPU as grids of blocks x warps x 32 lanes on several virtual GPUs at once, each GPU with
// its own global memory, streams and SMs, every CUDA thread a fiber on one OS thread.
//
// A seeded scheduler interleaves the threads at every synchronisation, wait and poll point (the
// same seed, the same run). The bulk-copy engine performs each cp.async.bulk at a later, seeded
// point, its destination poisoned until then. Every memory access of the kernels' code reaches
// the race detector through the compiler's ThreadSanitizer instrumentation (instrumentation.cc):
// vector clocks built from the primitives' happens-before (clock.h), shadow memory per byte
// (memory.h). What goes wrong is a report: a data race, a deadlock, a misused primitive, an
// out-of-bounds access, each naming the kernel, the thread and the source line.
#ifndef JAX_HYBRIDEP_LAB_HOST_EXECUTOR_EXECUTOR_H_
#define JAX_HYBRIDEP_LAB_HOST_EXECUTOR_EXECUTOR_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "lab/host_executor/clock.h"
#include "lab/host_executor/cuda.h"
#include "lab/host_executor/fiber.h"
#include "lab/host_executor/memory.h"
#include "lab/host_executor/ptx.h"

struct HostStream;

namespace jax_hybridep::host {

// What a run models; Configure() before the first CUDA call of a run.
struct Options {
  uint64_t seed = 0;
  int gpus = 8;                     // virtual GPUs (cudaGetDeviceCount)
  int sms = 2;                      // SMs per GPU, one resident block each
  int64_t optin_smem = 232448;      // cudaDevAttrMaxSharedMemoryPerBlockOptin
  double switch_probability = 0.5;  // at a scheduling point: another thread runs next
  double copy_probability = 0.25;   // per step: the copy engine performs a stage of a copy
  int64_t max_steps = 400000000;    // a run past this is a hang report
  int64_t step_ns = 1;              // virtual time per step (%globaltimer)
  bool detect_races = true;
};

// A failed run: the text names the kind, the kernel, the thread and the source line.
class Report : public std::runtime_error {
 public:
  explicit Report(const std::string& text) : std::runtime_error(text) {}
};

// Counters of the last run (tests and docs).
struct Stats {
  int64_t steps = 0;
  int64_t switches = 0;
  int64_t threads = 0;
  int64_t launches = 0;
  int64_t bulk_copies = 0;
  int64_t accesses = 0;
  uint64_t virtual_ns = 0;
};

void Configure(const Options& options);
// Frees every allocation, stream and kernel state: a new run.
void Reset();
const Options& CurrentOptions();
const Stats& CurrentStats();

// ---------------------------------------------------------------------------- internals

struct Block;
struct Launch;
struct BulkOp;

// An agent's view of the vector clocks: its id, its current event, the events of others that
// happen before its next access (`known`), and what its bulk copies are ordered after
// (`async_known` and its own event at its last proxy fence).
struct Knowledge {
  uint32_t id = 0;
  uint32_t event = 1;
  ClockRef known;
  ClockRef async_known;
  uint32_t async_event = 0;
  ClockRef relaxed_acquired;  // clocks read by relaxed atomics since the last fence
  ClockRef fence_release;     // what relaxed atomic writes publish: the last fence's snapshot

  ClockRef Snapshot() const { return With(known, id, event); }
  ClockRef AsyncSnapshot() const {
    return async_event == 0 ? async_known : With(async_known, id, async_event);
  }
};

// The join of several agents' clocks, generic and async: computed once from their shared
// knowledge and their own events, not from a copy per agent.
void JoinAgents(const std::vector<const Knowledge*>& agents, ClockRef* clock, ClockRef* async);

// A barrier's group (a block's __syncthreads, a warp's full __syncwarp) in the clocks: after its
// n-th barrier the group's two ids carry event n instead of an entry per member, and each
// member's events at its barriers say what that stands for (Executor::Knows).
struct BarrierGroup {
  uint32_t id = 0, async_id = 0;  // in generic and in async clocks
  uint32_t count = 0;             // barriers completed
};

enum class ThreadState { kRunnable, kBlocked, kSleeping, kDone };

// What a blocked or sleeping thread waits for (the deadlock report).
struct Wait {
  std::string what;
  const void* pc = nullptr;
  std::function<std::string()> state;  // the awaited object's state when the report is made
};

struct Thread {
  Knowledge k;
  Block* block = nullptr;
  uint3 index{};
  int linear = 0, warp = 0, lane = 0;
  Fiber fiber;
  ThreadState state = ThreadState::kRunnable;
  size_t runnable_slot = 0;
  uint64_t wake_ns = 0;
  Wait wait;
  std::vector<const void*> frames;  // the instrumented call stack (call sites)
  int shared_declarations = 0;
  uint64_t collective_result = 0;
  // Bulk store groups: the open one and the committed ones, oldest first.
  std::vector<BulkOp*> open_group;
  std::deque<std::vector<BulkOp*>> committed;
  size_t read_waited = 0;  // committed groups whose reads this thread already waited for
  char* stack_low = nullptr;
  char* stack_high = nullptr;
};

struct WarpCollective {
  enum Kind { kShuffle, kBallot, kSync, kMatch } kind;
  ShuffleKind shuffle = ShuffleKind::kIndex;
  unsigned mask = 0, arrived = 0;
  int width = 32;
  const void* pc = nullptr;
  uint64_t value[32] = {};
  int operand[32] = {};
  Thread* lanes[32] = {};
};

struct Warp {
  unsigned live = 0;  // lanes not yet exited
  std::vector<WarpCollective> pending;
  BarrierGroup* group = nullptr;  // its full __syncwarps (Executor::groups)
};

struct Mbarrier {
  uint32_t expected = 0, pending = 0;
  const Region* region = nullptr;
  int64_t tx = 0;
  uint32_t phase = 0;  // completed phases
  ClockRef phase_clock, phase_async;
  ClockRef completed_clock[2], completed_async[2];
  std::vector<std::pair<Thread*, uint32_t>> waiters;  // and the parity each waits for
};

struct Block {
  Launch* launch = nullptr;
  uint3 index{};
  int linear = 0;
  std::vector<std::unique_ptr<Thread>> threads;
  std::vector<Warp> warps;
  int live = 0;
  // __syncthreads
  int arrived = 0;
  const void* barrier_pc = nullptr;
  std::vector<Thread*> barrier_waiters;
  BarrierGroup* group = nullptr;  // its __syncthreads (Executor::groups)
  int barrier_and = 1, barrier_or = 0, barrier_count = 0;
  // Shared memory: the static declarations (in order) and the dynamic arena.
  std::vector<Region*> statics;
  std::vector<std::string> static_names;
  Region* dynamic = nullptr;
  std::unordered_map<const void*, Mbarrier> mbarriers;
};

struct Launch {
  ~Launch();
  const void* kernel = nullptr;
  dim3 grid, block;
  size_t smem = 0;
  std::shared_ptr<const KernelBody> body;
  HostStream* stream = nullptr;
  int gpu = 0;
  uint32_t record = 0;  // Executor::records
  ClockRef base;        // what every thread of the launch starts knowing (stream order)
  int64_t next_block = 0, blocks_done = 0, blocks_total = 0;
  int pending_ops = 0;                           // bulk copies issued and not yet performed
  std::vector<std::unique_ptr<BulkOp>> ops;      // every bulk copy its threads issued
  std::vector<const Knowledge*> finals;          // its exited threads' and finished copies' clocks
  std::vector<std::unique_ptr<Knowledge>> kept;  // the exited threads' clocks, kept for the join
};

// One cp.async.bulk: an agent of its own, reading at event 1 and writing at event 2.
struct BulkOp {
  Knowledge k;        // the async view: what its accesses are ordered after
  Knowledge generic;  // what its writes are checked against earlier reads with
  bool load = false;  // global -> shared (completes on an mbarrier), else shared -> global
  char* dst = nullptr;
  const char* src = nullptr;
  uint32_t bytes = 0;
  uint64_t* bar = nullptr;  // load: the barrier its bytes complete on
  Block* block = nullptr;   // the issuing block (its shared memory)
  Launch* launch = nullptr;
  uint32_t issuer = 0;  // the issuing thread's agent id
  const void* pc = nullptr;
  bool read_done = false, write_done = false;
  std::vector<char> data;
};

struct FreeDeleter {
  void operator()(char* p) const;
};

struct StreamOp {
  enum Kind { kLaunch, kMemset, kMemcpy } kind = kLaunch;
  std::unique_ptr<Launch> launch;
  char* dst = nullptr;
  const char* src = nullptr;
  size_t bytes = 0;
  int value = 0;
  std::unique_ptr<char, FreeDeleter> owned_src;  // pageable (not pinned) memory, staged
};

// Who an agent id was (reports).
struct AgentInfo {
  enum Kind { kThread, kBulkCopy, kStreamOp, kLaunch } kind = kThread;
  uint32_t record = 0;       // the kernel launch it belongs to (Executor::records), 0: none
  uint32_t last_access = 0;  // its event at its last memory access (0: none yet)
  // A thread: its block's and warp's barrier groups, and its events (generic, async) when it
  // reached each of their barriers.
  const BarrierGroup* block_group = nullptr;
  const BarrierGroup* warp_group = nullptr;
  std::vector<std::pair<uint32_t, uint32_t>> block_events, warp_events;
  int gpu = 0;
  const void* kernel = nullptr;
  uint3 block{}, thread{};
  int warp = 0, lane = 0;
  uint32_t issuer = 0;  // bulk copy: the issuing thread
  const void* pc = nullptr;
  std::string what;  // bulk copy / stream op description
};

// A kernel launch in the clocks: once it has finished, a clock that knows every access of its
// agents names the launch's own id instead of theirs (Executor::Compact), so the clocks of later
// launches stay small.
struct LaunchRecord {
  std::vector<uint32_t> agents;
  uint32_t summary = 0;  // the launch's id, once finished
  size_t accessing = 0;  // then: its agents that accessed memory
};

class Executor;
Executor& TheExecutor();
Thread* CurrentThread();

// The instrumentation's entry: a kernel thread's plain or volatile (relaxed) access.
void OnAccess(const void* address, size_t bytes, bool write, bool relaxed, const void* pc);

}  // namespace jax_hybridep::host

// A stream of a virtual GPU (cudaStream_t).
struct HostStream {
  int gpu = 0;
  std::deque<jax_hybridep::host::StreamOp> ops;
  bool running = false;               // ops.front() started
  jax_hybridep::host::ClockRef base;  // everything completed on this stream so far
};

#endif  // JAX_HYBRIDEP_LAB_HOST_EXECUTOR_EXECUTOR_H_
