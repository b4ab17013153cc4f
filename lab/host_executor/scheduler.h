// The host executor's state and scheduler (executor.h), shared by its parts: the scheduler
// (executor.cc), launches and blocks (launches.cc), memory checks and reports (reports.cc), the
// device primitives (collectives.cc, atomics.cc, bulk_copies.cc) and the CUDA runtime API
// (runtime_api.cc). Not for kernel code.
#ifndef JAX_HYBRIDEP_LAB_HOST_EXECUTOR_SCHEDULER_H_
#define JAX_HYBRIDEP_LAB_HOST_EXECUTOR_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "lab/host_executor/executor.h"

namespace jax_hybridep::host {

// The clocks an atomic location (a flag, a counter) carries between releases and acquires.
struct SyncVar {
  ClockRef clock, async;
};

class Executor {
 public:
  struct Gpu {
    std::vector<std::unique_ptr<HostStream>> streams;  // [0]: the default stream
    int free_slots = 0;
  };

  Options options;
  Stats stats;
  Memory memory;
  uint64_t rng_state = 1;  // splitmix64: the seed's whole schedule
  std::vector<Gpu> gpus;
  int current_gpu = 0;
  cudaError_t last_error = cudaSuccess;
  std::unordered_map<const void*, int> max_dynamic_smem;  // cudaFuncSetAttribute

  uint64_t now_ns = 0;
  std::vector<AgentInfo> agents;      // by agent id (0: none)
  std::vector<LaunchRecord> records;  // by Launch::record (0: none)
  std::deque<BarrierGroup> groups;    // barrier groups of this epoch's blocks and warps
  std::unordered_map<const void*, SyncVar> sync_vars;

  // The scheduler's view of the threads.
  std::vector<Thread*> runnable;
  // Sleeping threads, a min-heap by (wake time, sequence): the earliest first, ties in order.
  struct Sleeper {
    uint64_t wake_ns, sequence;
    Thread* thread;
    bool operator>(const Sleeper& o) const {
      return wake_ns != o.wake_ns ? wake_ns > o.wake_ns : sequence > o.sequence;
    }
  };
  std::vector<Sleeper> sleepers;
  uint64_t sleep_sequence = 0;
  bool streams_changed = true;                 // a stream may have work to start
  std::vector<Thread*> bulk_waiters;           // blocked in cp.async.bulk.wait_group
  std::vector<std::unique_ptr<Block>> blocks;  // resident
  std::vector<BulkOp*> in_flight;              // bulk copies not yet performed
  Thread* current = nullptr;

  bool failed = false;
  std::function<std::string()> failure;  // the report, formatted on the scheduler's stack
  uint64_t progress = 0;                 // writes so far: polling with none in between is idle
  uint64_t idle_progress = ~0ull;
  uint64_t idle_stretch_ns = 0;

  Executor();
  void Reset();

  // Runs the virtual GPUs until done() (or a report, thrown as Report).
  void RunUntil(const std::function<bool()>& done);
  bool StreamIdle(const HostStream* stream) const { return stream->ops.empty(); }
  bool AllIdle() const;
  HostStream* Stream(cudaStream_t stream);
  cudaError_t Enqueue(HostStream* stream, StreamOp op);

  // Agents and clocks.
  uint32_t NewAgent(AgentInfo info);
  // Whether the event `event` of agent `other` happens before k's next access.
  bool Knows(const Knowledge& k, uint32_t other, uint32_t event) const {
    if (other == 0) return true;
    if (other == k.id) return event <= k.event;
    if (Lookup(k.known, other) >= event) return true;
    const AgentInfo& a = agents[other];
    if (a.block_group != nullptr && (ThroughBarriers(k, *a.block_group, a.block_events, event) ||
                                     ThroughBarriers(k, *a.warp_group, a.warp_events, event))) {
      return true;
    }
    return a.record != 0 && records[a.record].summary != 0 &&
           Lookup(k.known, records[a.record].summary) != 0;
  }
  // Whether k knows a barrier of `group` that the agent reached at or after `event`.
  static bool ThroughBarriers(const Knowledge& k, const BarrierGroup& group,
                              const std::vector<std::pair<uint32_t, uint32_t>>& events,
                              uint32_t event) {
    if (events.empty()) return false;
    for (int async = 0; async < 2; ++async) {
      const uint32_t n = Lookup(k.known, async ? group.async_id : group.id);
      if (n == 0) continue;
      const auto& at = events[std::min<size_t>(n, events.size()) - 1];
      if ((async ? at.second : at.first) >= event) return true;
    }
    return false;
  }
  // Completes a barrier of `group` for `members` (each arrived with its current events).
  void CompleteBarrier(BarrierGroup& group, const std::vector<Knowledge*>& members, bool block);
  // `clock` with the agents of finished launches it knows completely replaced by the launch.
  ClockRef Compact(const ClockRef& clock) const;
  // Compact, for a clock large enough that later joins and lookups would pay for its size.
  ClockRef CompactLarge(const ClockRef& clock) const {
    return clock && clock->size() > 512 ? Compact(clock) : clock;
  }
  uint64_t Next() {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  bool Chance(double p) { return static_cast<double>(Next() >> 11) * 0x1.0p-53 < p; }
  size_t Pick(size_t n) { return static_cast<size_t>((Next() >> 32) * n >> 32); }

  // Memory accesses by an agent (a thread, a bulk copy, a stream operation), checked: bounds,
  // bulk copies in flight, races. A write is checked against earlier reads with `read_view`
  // when given (a bulk copy's generic view: a read ordered before the copy's issue needs no
  // proxy fence), else with k.
  void Access(Knowledge& k, const Knowledge* read_view, const void* address, size_t bytes,
              bool write, bool relaxed, const void* pc, const Block* block);

  // Thread scheduling (on the thread's fiber).
  void Point(Thread* t);  // a scheduling point: another thread may run first
  void BlockOn(Thread* t, Wait wait);
  void Wake(Thread* t);
  void Sleep(Thread* t, uint64_t ns);
  // Ends the run with a report (on a fiber: never returns to it).
  void Fail(std::function<std::string()> report);

  // Bulk copies.
  void PerformStage(BulkOp* op);
  void RecheckBulkWaiters();
  static bool GroupsDone(const Thread* t, size_t count, bool read_only);

  // Descriptions for reports.
  std::string Describe(uint32_t agent) const;
  std::string DescribeThread(const Thread* t) const;

 private:
  void StartStreams();
  void StartBlock(Launch* launch, int gpu);
  void FinishBlock(Block* block);
  void MaybeFinishLaunch(Launch* launch);
  void PerformMemoryOp(HostStream* stream, StreamOp& op);
  void Resume(Thread* t);
  void WakeSleepers();
  // Every live thread, a line per group of lanes waiting alike: what it waits for, where.
  std::string ThreadsReport() const;
  void ResetEpochs();
};

// Releases the threads waiting at the block's __syncthreads (all live ones arrived).
void CompleteBlockBarrier(Block* block);

// Set while a kernel thread's fiber runs (the instrumentation's fast path).
extern Thread* g_thread;

// The source location of a code address: "file:line (function)", inlined frames joined by " <- ".
std::string Symbolize(const void* pc);
// A kernel's name from its entry address.
std::string KernelName(const void* kernel);

}  // namespace jax_hybridep::host

#endif  // JAX_HYBRIDEP_LAB_HOST_EXECUTOR_SCHEDULER_H_
