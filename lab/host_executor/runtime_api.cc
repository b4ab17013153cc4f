// The CUDA runtime API on the host executor's virtual GPUs (cuda.h): devices, allocations,
// streams, copies, launches and errors. Synchronising calls run the scheduler until the awaited
// work is done and throw a Report when a run fails.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "lab/host_executor/init_tracking.h"
#include "lab/host_executor/scheduler.h"

namespace hx = jax_hybridep::host;

namespace {

hx::Executor& E() { return hx::TheExecutor(); }

cudaError_t Status(cudaError_t s) {
  if (s != cudaSuccess) E().last_error = s;
  return s;
}

constexpr int kDefaultSharedBytes = 48 << 10;

// Enqueues a memory operation and, for the synchronous calls, waits for it.
cudaError_t Memory(cudaStream_t stream, hx::StreamOp op, bool wait) {
  hx::Executor& e = E();
  if (e.failed) return cudaErrorLaunchFailure;
  HostStream* s = e.Stream(stream);
  if (op.kind == hx::StreamOp::kMemcpy && e.memory.Find(op.src) == nullptr) {
    // Pageable (not pinned) memory: consumed when the call returns, as CUDA stages it.
    auto* staged = static_cast<char*>(std::malloc(std::max<size_t>(op.bytes, 1)));
    std::memcpy(staged, op.src, op.bytes);
    op.src = staged;
    op.owned_src.reset(staged);
  }
  e.Enqueue(s, std::move(op));
  if (wait) {
    e.RunUntil([s] { return s->ops.empty(); });
    if (e.failed) return Status(cudaErrorLaunchFailure);
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t cudaGetDeviceCount(int* count) {
  *count = static_cast<int>(E().gpus.size());
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = E().current_gpu;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= static_cast<int>(E().gpus.size())) {
    return Status(cudaErrorInvalidDevice);
  }
  E().current_gpu = device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  const hx::Options& o = E().options;
  if (device < 0 || device >= static_cast<int>(E().gpus.size())) {
    return Status(cudaErrorInvalidDevice);
  }
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = o.sms;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = kDefaultSharedBytes;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(o.optin_smem);
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      return cudaSuccess;
  }
  return Status(cudaErrorInvalidValue);
}

cudaError_t cudaDeviceCanAccessPeer(int* can, int, int) {
  *can = 1;
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned) {
  if (peer < 0 || peer >= static_cast<int>(E().gpus.size())) return Status(cudaErrorInvalidDevice);
  if (!hx::EnablePeerAccess(E().current_gpu, peer))
    return Status(cudaErrorPeerAccessAlreadyEnabled);
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  hx::Executor& e = E();
  if (e.failed) return cudaErrorLaunchFailure;
  auto& streams = e.gpus[e.current_gpu].streams;
  e.RunUntil([&streams] {
    return std::all_of(streams.begin(), streams.end(),
                       [](const std::unique_ptr<HostStream>& s) { return s->ops.empty(); });
  });
  return e.failed ? Status(cudaErrorLaunchFailure) : cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t s = E().last_error;
  E().last_error = cudaSuccess;
  return s;
}

cudaError_t cudaPeekAtLastError() { return E().last_error; }

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError:
      return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer:
      return "cudaErrorInvalidDevicePointer";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorPeerAccessAlreadyEnabled:
      return "cudaErrorPeerAccessAlreadyEnabled";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure (the host executor's run failed)";
    default:
      return cudaGetErrorName(error);
  }
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  hx::Executor& e = E();
  hx::Region* r = e.memory.Allocate(bytes, 256, hx::RegionKind::kGlobal, e.current_gpu, nullptr,
                                    "global memory (" + std::to_string(bytes) + " bytes)");
  if (r == nullptr) return Status(cudaErrorMemoryAllocation);
  hx::TrackInitialisation(r->begin, bytes);  // poisoned and uninitialised (initcheck)
  *ptr = r->begin;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  hx::ForgetInitialisation(ptr);
  return E().memory.Free(ptr) ? cudaSuccess : Status(cudaErrorInvalidDevicePointer);
}

cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned) {
  hx::Region* r =
      E().memory.Allocate(bytes, 64, hx::RegionKind::kMapped, -1, nullptr, "mapped memory");
  if (r == nullptr) return Status(cudaErrorMemoryAllocation);
  *ptr = r->begin;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) { return cudaFree(ptr); }

cudaError_t cudaHostGetDevicePointer(void** device, void* mapped, unsigned) {
  *device = mapped;  // one address space
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  hx::StreamOp op{};
  op.kind = hx::StreamOp::kMemset;
  op.dst = static_cast<char*>(ptr);
  op.value = value;
  op.bytes = bytes;
  return Memory(stream, std::move(op), false);
}

cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  hx::StreamOp op{};
  op.kind = hx::StreamOp::kMemset;
  op.dst = static_cast<char*>(ptr);
  op.value = value;
  op.bytes = bytes;
  return Memory(nullptr, std::move(op), true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                            cudaStream_t stream) {
  hx::StreamOp op{};
  op.kind = hx::StreamOp::kMemcpy;
  op.dst = static_cast<char*>(dst);
  op.src = static_cast<const char*>(src);
  op.bytes = bytes;
  return Memory(stream, std::move(op), false);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  hx::StreamOp op{};
  op.kind = hx::StreamOp::kMemcpy;
  op.dst = static_cast<char*>(dst);
  op.src = static_cast<const char*>(src);
  op.bytes = bytes;
  return Memory(nullptr, std::move(op), true);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  hx::Executor& e = E();
  auto s = std::make_unique<HostStream>();
  s->gpu = e.current_gpu;
  *stream = s.get();
  e.gpus[e.current_gpu].streams.push_back(std::move(s));
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t) {
  return cudaSuccess;  // streams live until the executor's next Reset
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  hx::Executor& e = E();
  if (e.failed) return cudaErrorLaunchFailure;
  HostStream* s = e.Stream(stream);
  e.RunUntil([s] { return s->ops.empty(); });
  return e.failed ? Status(cudaErrorLaunchFailure) : cudaSuccess;
}

namespace jax_hybridep::host {

cudaError_t SetFuncAttribute(const void* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      value > E().options.optin_smem) {
    return Status(cudaErrorInvalidValue);
  }
  E().max_dynamic_smem[kernel] = value;
  return cudaSuccess;
}

cudaError_t GetFuncAttributes(cudaFuncAttributes* attrs, const void* kernel) {
  *attrs = cudaFuncAttributes{};
  attrs->maxThreadsPerBlock = 1024;
  auto it = E().max_dynamic_smem.find(kernel);
  attrs->maxDynamicSharedSizeBytes =
      it == E().max_dynamic_smem.end() ? kDefaultSharedBytes : it->second;
  return cudaSuccess;
}

cudaError_t LaunchBody(const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       std::shared_ptr<const KernelBody> body) {
  Executor& e = E();
  if (e.failed) return Status(cudaErrorLaunchFailure);
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  const uint64_t blocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
  if (threads == 0 || threads > 1024 || blocks == 0) return Status(cudaErrorInvalidConfiguration);
  // More dynamic shared memory than the default needs the kernel's opt-in, as on a GPU.
  auto it = e.max_dynamic_smem.find(kernel);
  const size_t allowed =
      it == e.max_dynamic_smem.end() ? kDefaultSharedBytes : static_cast<size_t>(it->second);
  if (smem > allowed) return Status(cudaErrorInvalidValue);
  HostStream* s = e.Stream(stream);
  auto launch = std::make_unique<Launch>();
  launch->kernel = kernel;
  launch->grid = grid;
  launch->block = block;
  launch->smem = smem;
  launch->body = std::move(body);
  launch->stream = s;
  launch->gpu = s->gpu;
  launch->blocks_total = static_cast<int64_t>(blocks);
  StreamOp op{};
  op.kind = StreamOp::kLaunch;
  op.launch = std::move(launch);
  return Status(e.Enqueue(s, std::move(op)));
}

}  // namespace jax_hybridep::host
