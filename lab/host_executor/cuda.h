// CUDA as the host executor presents it to kernel sources compiled by the C++ compiler
// (docs/host_executor.md): the language's qualifiers and built-in variables, the vector types,
// the warp, block and atomic intrinsics, and the runtime API the launchers call, each backed by
// the executor's model of the hardware (executor.h). `include/cuda_runtime.h` and
// `include/cuda_runtime_api.h` forward here, so the kernels' own #includes find it.
//
// Only what the kernels use is here: a kernel that starts using something else fails to compile
// for the executor until it models it.
#ifndef JAX_HYBRIDEP_LAB_HOST_EXECUTOR_CUDA_H_
#define JAX_HYBRIDEP_LAB_HOST_EXECUTOR_CUDA_H_

#ifndef JAX_HYBRIDEP_HOST_EXECUTOR
#error \
    "lab/host_executor/cuda.h is the host executor's CUDA: build with -DJAX_HYBRIDEP_HOST_EXECUTOR"
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------------------- the language

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __maxnreg__(n)
#define __grid_constant__
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

namespace jax_hybridep::host {
uint3 ThreadIdx();
uint3 BlockIdx();
dim3 BlockDim();
dim3 GridDim();
}  // namespace jax_hybridep::host

#define threadIdx (::jax_hybridep::host::ThreadIdx())
#define blockIdx (::jax_hybridep::host::BlockIdx())
#define blockDim (::jax_hybridep::host::BlockDim())
#define gridDim (::jax_hybridep::host::GridDim())

// ---------------------------------------------------------------------------- intrinsics

namespace jax_hybridep::host {
enum class ShuffleKind { kIndex, kXor, kUp, kDown };
uint64_t Shuffle(unsigned mask, uint64_t bits, ShuffleKind kind, int operand, int width);
unsigned Ballot(unsigned mask, int predicate);
unsigned MatchAny(unsigned mask, uint64_t bits);
void SyncWarp(unsigned mask);
enum class BarrierReduce { kNone, kAnd, kOr, kCount };
int SyncThreads(BarrierReduce reduce, int predicate);
enum class AtomicOp { kAdd, kMax, kMin, kExch, kCas, kAnd, kOr };
uint64_t Atomic(AtomicOp op, void* address, int bytes, uint64_t operand, uint64_t compare,
                bool is_signed);
float AtomicAddFloat(float* address, float value);
enum class FenceScope { kBlock, kDevice, kSystem };
void Fence(FenceScope scope);
void NanoSleep(unsigned ns);

template <typename T>
uint64_t ToBits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a wide type");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}
template <typename T>
T FromBits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}
template <typename T>
uint64_t AtomicBits(T v) {
  return static_cast<uint64_t>(v);
}
}  // namespace jax_hybridep::host

inline void __syncthreads() {
  ::jax_hybridep::host::SyncThreads(::jax_hybridep::host::BarrierReduce::kNone, 0);
}
inline int __syncthreads_and(int p) {
  return ::jax_hybridep::host::SyncThreads(::jax_hybridep::host::BarrierReduce::kAnd, p);
}
inline int __syncthreads_or(int p) {
  return ::jax_hybridep::host::SyncThreads(::jax_hybridep::host::BarrierReduce::kOr, p);
}
inline int __syncthreads_count(int p) {
  return ::jax_hybridep::host::SyncThreads(::jax_hybridep::host::BarrierReduce::kCount, p);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::jax_hybridep::host::SyncWarp(mask); }
inline unsigned __ballot_sync(unsigned mask, int p) {
  return ::jax_hybridep::host::Ballot(mask, p);
}

// The lanes of `mask` whose `v` has this lane's bits (integers and floats alike compare bits).
template <typename T>
inline unsigned __match_any_sync(unsigned mask, T v) {
  return ::jax_hybridep::host::MatchAny(mask, ::jax_hybridep::host::ToBits(v));
}

#define JAX_HYBRIDEP_HOST_SHUFFLE(name, kind, operand_type)                        \
  template <typename T>                                                            \
  inline T name(unsigned mask, T v, operand_type operand, int width = 32) {        \
    namespace hx = ::jax_hybridep::host;                                           \
    return hx::FromBits<T>(hx::Shuffle(mask, hx::ToBits(v), hx::ShuffleKind::kind, \
                                       static_cast<int>(operand), width));         \
  }
JAX_HYBRIDEP_HOST_SHUFFLE(__shfl_sync, kIndex, int)
JAX_HYBRIDEP_HOST_SHUFFLE(__shfl_xor_sync, kXor, int)
JAX_HYBRIDEP_HOST_SHUFFLE(__shfl_up_sync, kUp, unsigned)
JAX_HYBRIDEP_HOST_SHUFFLE(__shfl_down_sync, kDown, unsigned)
#undef JAX_HYBRIDEP_HOST_SHUFFLE

#define JAX_HYBRIDEP_HOST_ATOMIC(name, op, type)                                                 \
  inline type name(type* a, type v) {                                                            \
    namespace hx = ::jax_hybridep::host;                                                         \
    return static_cast<type>(hx::Atomic(hx::AtomicOp::op, a, sizeof(type), hx::AtomicBits(v), 0, \
                                        std::is_signed_v<type>));                                \
  }
JAX_HYBRIDEP_HOST_ATOMIC(atomicAdd, kAdd, int)
JAX_HYBRIDEP_HOST_ATOMIC(atomicAdd, kAdd, unsigned)
JAX_HYBRIDEP_HOST_ATOMIC(atomicAdd, kAdd, unsigned long long)
JAX_HYBRIDEP_HOST_ATOMIC(atomicMax, kMax, int)
JAX_HYBRIDEP_HOST_ATOMIC(atomicMax, kMax, unsigned)
JAX_HYBRIDEP_HOST_ATOMIC(atomicMax, kMax, unsigned long long)
JAX_HYBRIDEP_HOST_ATOMIC(atomicMin, kMin, int)
JAX_HYBRIDEP_HOST_ATOMIC(atomicMin, kMin, unsigned)
JAX_HYBRIDEP_HOST_ATOMIC(atomicExch, kExch, int)
JAX_HYBRIDEP_HOST_ATOMIC(atomicExch, kExch, unsigned)
JAX_HYBRIDEP_HOST_ATOMIC(atomicExch, kExch, unsigned long long)
JAX_HYBRIDEP_HOST_ATOMIC(atomicAnd, kAnd, unsigned)
JAX_HYBRIDEP_HOST_ATOMIC(atomicOr, kOr, unsigned)
#undef JAX_HYBRIDEP_HOST_ATOMIC
inline float atomicAdd(float* a, float v) { return ::jax_hybridep::host::AtomicAddFloat(a, v); }

#define JAX_HYBRIDEP_HOST_CAS(type)                                                             \
  inline type atomicCAS(type* a, type compare, type v) {                                        \
    namespace hx = ::jax_hybridep::host;                                                        \
    return static_cast<type>(hx::Atomic(hx::AtomicOp::kCas, a, sizeof(type), hx::AtomicBits(v), \
                                        hx::AtomicBits(compare), false));                       \
  }
JAX_HYBRIDEP_HOST_CAS(int)
JAX_HYBRIDEP_HOST_CAS(unsigned)
JAX_HYBRIDEP_HOST_CAS(unsigned long long)
#undef JAX_HYBRIDEP_HOST_CAS

inline void __threadfence_block() {
  ::jax_hybridep::host::Fence(::jax_hybridep::host::FenceScope::kBlock);
}
inline void __threadfence() {
  ::jax_hybridep::host::Fence(::jax_hybridep::host::FenceScope::kDevice);
}
inline void __threadfence_system() {
  ::jax_hybridep::host::Fence(::jax_hybridep::host::FenceScope::kSystem);
}
inline void __nanosleep(unsigned ns) { ::jax_hybridep::host::NanoSleep(ns); }

// Pure functions: computed where they stand.
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(static_cast<unsigned>(v)); }
// Round-to-nearest float arithmetic: what the CPU does anyway (built with -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __int_as_float(int v) {
  return ::jax_hybridep::host::FromBits<float>(static_cast<uint32_t>(v));
}
inline float __uint_as_float(unsigned v) { return ::jax_hybridep::host::FromBits<float>(v); }
inline unsigned __float_as_uint(float v) {
  return static_cast<unsigned>(::jax_hybridep::host::ToBits(v));
}
inline int __float_as_int(float v) {
  return static_cast<int>(static_cast<uint32_t>(::jax_hybridep::host::ToBits(v)));
}

// ---------------------------------------------------------------------------- runtime API

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorNotReady = 600,
  cudaErrorPeerAccessAlreadyEnabled = 704,
  cudaErrorLaunchFailure = 719,
};
using cudaError_t = cudaError;

struct HostStream;  // executor.h
using cudaStream_t = HostStream*;

enum cudaDeviceAttr {
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};
struct cudaFuncAttributes {
  size_t sharedSizeBytes;
  size_t constSizeBytes;
  size_t localSizeBytes;
  int maxThreadsPerBlock;
  int numRegs;
  int ptxVersion;
  int binaryVersion;
  int cacheModeCA;
  int maxDynamicSharedSizeBytes;
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
constexpr unsigned cudaStreamDefault = 0;
constexpr unsigned cudaStreamNonBlocking = 1;
constexpr unsigned cudaHostAllocDefault = 0;
constexpr unsigned cudaHostAllocPortable = 1;
constexpr unsigned cudaHostAllocMapped = 2;

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);
const char* cudaGetErrorName(cudaError_t error);
cudaError_t cudaMalloc(void** ptr, size_t bytes);
template <typename T>
cudaError_t cudaMalloc(T** ptr, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
}
cudaError_t cudaFree(void* ptr);
cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaHostGetDevicePointer(void** device, void* mapped, unsigned flags);
cudaError_t cudaMemset(void* ptr, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);

namespace jax_hybridep::host {
cudaError_t SetFuncAttribute(const void* kernel, cudaFuncAttribute attr, int value);
cudaError_t GetFuncAttributes(cudaFuncAttributes* attrs, const void* kernel);

// A kernel launch, type-erased: Run() calls the kernel with a copy of its parameters (one copy
// per launch: the grid's constants).
struct KernelBody {
  virtual ~KernelBody() = default;
  virtual void Run() const = 0;
};
cudaError_t LaunchBody(const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       std::shared_ptr<const KernelBody> body);

template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, Args&&... args) {
  struct Body final : KernelBody {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> params;
    Body(void (*k)(Params...), Args&&... a) : kernel(k), params(std::forward<Args>(a)...) {}
    void Run() const override { std::apply(kernel, params); }
  };
  return LaunchBody(reinterpret_cast<const void*>(kernel), grid, block, smem, stream,
                    std::make_shared<const Body>(kernel, std::forward<Args>(args)...));
}
}  // namespace jax_hybridep::host

template <typename T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  return ::jax_hybridep::host::SetFuncAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
template <typename T>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attrs, T* kernel) {
  return ::jax_hybridep::host::GetFuncAttributes(attrs, reinterpret_cast<const void*>(kernel));
}

#endif  // JAX_HYBRIDEP_LAB_HOST_EXECUTOR_CUDA_H_
