// Grids on the host executor's virtual GPUs (scheduler.h): streams started in order, a launch's
// blocks placed on free SMs, each thread a fiber from its first instruction to its exit, finished
// blocks and launches retired, memsets and memcpys performed, epochs reset between runs.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "lab/host_executor/init_tracking.h"
#include "lab/host_executor/scheduler.h"

namespace jax_hybridep::host {

// ---------------------------------------------------------------------------- grids

namespace {

void ThreadMain(void* arg) {
  auto* t = static_cast<Thread*>(arg);
  Executor& e = TheExecutor();
  t->block->launch->body->Run();
  // The kernel returned: this thread has exited.
  t->state = ThreadState::kDone;
  Block* b = t->block;
  b->launch->kept.push_back(std::make_unique<Knowledge>(t->k));
  b->launch->finals.push_back(b->launch->kept.back().get());
  Warp& w = b->warps[t->warp];
  w.live &= ~(1u << t->lane);
  --b->live;
  Thread* last = e.runnable.back();
  e.runnable[t->runnable_slot] = last;
  last->runnable_slot = t->runnable_slot;
  e.runnable.pop_back();
  // A lane a pending warp collective names has exited: it can never complete.
  for (const WarpCollective& c : w.pending) {
    if (c.mask & (1u << t->lane)) {
      const uint32_t who = t->k.id;
      const void* pc = c.pc;
      e.Fail([&e, who, pc] {
        return "warp collective with an exited lane: " + e.Describe(who) +
               " exited while other lanes of its mask wait at " + Symbolize(pc);
      });
    }
  }
  // Exited threads no longer count at __syncthreads.
  if (!b->barrier_waiters.empty() && b->arrived == b->live) CompleteBlockBarrier(b);
  t->fiber.Return();  // never resumed
}

}  // namespace

void Executor::StartStreams() {
  for (int g = 0; g < static_cast<int>(gpus.size()); ++g) {
    for (auto& s : gpus[g].streams) {
      while (!s->ops.empty() && !s->running) {
        StreamOp& op = s->ops.front();
        if (op.kind == StreamOp::kLaunch) {
          op.launch->base = s->base;
          op.launch->record = static_cast<uint32_t>(records.size());
          records.emplace_back();
          s->running = true;
          ++stats.launches;
        } else {
          PerformMemoryOp(s.get(), op);
          if (failed) return;
          s->ops.pop_front();
        }
      }
    }
    // Free SMs take the next blocks of the running launches, streams in order.
    for (auto& s : gpus[g].streams) {
      if (!s->running) continue;
      Launch* launch = s->ops.front().launch.get();
      while (gpus[g].free_slots > 0 && launch->next_block < launch->blocks_total) {
        --gpus[g].free_slots;
        StartBlock(launch, g);
      }
      MaybeFinishLaunch(launch);
    }
  }
}

void Executor::StartBlock(Launch* launch, int gpu) {
  auto block = std::make_unique<Block>();
  Block* b = block.get();
  b->launch = launch;
  b->linear = static_cast<int>(launch->next_block++);
  const unsigned gx = launch->grid.x, gy = launch->grid.y;
  b->index = uint3{b->linear % gx, (b->linear / gx) % gy, b->linear / (gx * gy)};
  const int n = static_cast<int>(launch->block.x * launch->block.y * launch->block.z);
  b->live = n;
  b->warps.resize((n + 31) / 32);
  AgentInfo group_info;
  group_info.kind = AgentInfo::kLaunch;
  group_info.gpu = gpu;
  group_info.kernel = launch->kernel;
  group_info.record = launch->record;
  auto new_group = [&] {
    groups.emplace_back();
    groups.back().id = NewAgent(group_info);
    groups.back().async_id = NewAgent(group_info);
    return &groups.back();
  };
  b->group = new_group();
  for (Warp& w : b->warps) w.group = new_group();
  // Zero bytes too: an extern __shared__ array of a launch without dynamic shared memory is
  // then a red zone.
  b->dynamic =
      memory.Allocate(launch->smem, 128, RegionKind::kShared, gpu, b, "dynamic shared memory");
  for (int i = 0; i < n; ++i) {
    auto t = std::make_unique<Thread>();
    t->block = b;
    t->linear = i;
    const unsigned bx = launch->block.x, by = launch->block.y;
    t->index = uint3{i % bx, (i / bx) % by, i / (bx * by)};
    t->warp = i / 32;
    t->lane = i % 32;
    b->warps[t->warp].live |= 1u << t->lane;
    AgentInfo info;
    info.kind = AgentInfo::kThread;
    info.gpu = gpu;
    info.kernel = launch->kernel;
    info.block = b->index;
    info.thread = t->index;
    info.warp = t->warp;
    info.lane = t->lane;
    info.record = launch->record;
    info.block_group = b->group;
    info.warp_group = b->warps[t->warp].group;
    t->k.id = NewAgent(info);
    t->k.known = launch->base;
    t->k.async_known = launch->base;
    t->fiber.Start(&ThreadMain, t.get());
    t->stack_low = t->fiber.StackLow();
    t->stack_high = t->fiber.StackHigh();
    t->runnable_slot = runnable.size();
    runnable.push_back(t.get());
    b->threads.push_back(std::move(t));
    ++stats.threads;
  }
  blocks.push_back(std::move(block));
}

void Executor::FinishBlock(Block* b) {
  Launch* launch = b->launch;
  // Bulk copies that still need the block's shared memory.
  for (const BulkOp* op : in_flight) {
    if (op->block != b) continue;
    const bool needs = op->load ? !op->write_done : !op->read_done;
    if (!needs) continue;
    const std::string issuer = Describe(op->issuer);
    const void* pc = op->pc;
    const bool load = op->load;
    Fail([issuer, pc, load] {
      return std::string("bulk copy outlives its block: ") +
             (load ? "a cp.async.bulk into shared memory" : "a cp.async.bulk from shared memory") +
             " issued by " + issuer + " at " + Symbolize(pc) +
             " was still in flight when the block exited" +
             (load ? " (nobody waited for its mbarrier)"
                   : " (no cp.async.bulk.wait_group.read before the exit)");
    });
    return;
  }
  for (Region* r : b->statics) memory.Free(r->begin);
  memory.Free(b->dynamic->begin);
  ++launch->blocks_done;
  ++gpus[launch->gpu].free_slots;
  streams_changed = true;
  auto it = std::find_if(blocks.begin(), blocks.end(),
                         [b](const std::unique_ptr<Block>& p) { return p.get() == b; });
  blocks.erase(it);
  MaybeFinishLaunch(launch);
}

void Executor::MaybeFinishLaunch(Launch* launch) {
  if (launch->blocks_done < launch->blocks_total || launch->pending_ops > 0) return;
  HostStream* s = launch->stream;
  if (!s->running || s->ops.empty() || s->ops.front().launch.get() != launch) return;
  for (const auto& op : launch->ops) launch->finals.push_back(&op->k);
  ClockRef finished;
  JoinAgents(launch->finals, &finished, nullptr);
  AgentInfo info;
  info.kind = AgentInfo::kLaunch;
  info.gpu = launch->gpu;
  info.kernel = launch->kernel;
  LaunchRecord& record = records[launch->record];
  record.summary = NewAgent(info);
  for (uint32_t id : record.agents) record.accessing += agents[id].last_access != 0;
  s->base = Compact(With(Join(s->base, finished), records[launch->record].summary, 1));
  s->running = false;
  s->ops.pop_front();
  streams_changed = true;
}

void Executor::PerformMemoryOp(HostStream* s, StreamOp& op) {
  AgentInfo info;
  info.kind = AgentInfo::kStreamOp;
  info.gpu = s->gpu;
  info.what = op.kind == StreamOp::kMemset ? "cudaMemsetAsync" : "cudaMemcpyAsync";
  Knowledge k;
  k.id = NewAgent(info);
  k.known = s->base;
  if (op.kind == StreamOp::kMemcpy) {
    Access(k, nullptr, op.src, op.bytes, false, false, nullptr, nullptr);
  }
  Access(k, nullptr, op.dst, op.bytes, true, false, nullptr, nullptr);
  if (failed) return;
  if (op.kind == StreamOp::kMemset) {
    std::memset(op.dst, op.value, op.bytes);
  } else {
    std::memmove(op.dst, op.src, op.bytes);
    CopyInitialisation(op.dst, op.src, op.bytes);
  }
  s->base = Join(s->base, k.Snapshot());
}

void Executor::ResetEpochs() {
  memory.ResetEpochs();
  agents.assign(1, AgentInfo());
  records.assign(1, LaunchRecord());
  groups.clear();
  sync_vars.clear();
  for (Gpu& g : gpus) {
    for (auto& s : g.streams) s->base = nullptr;
  }
}

}  // namespace jax_hybridep::host
